#!/bin/sh
# A scratch PostgreSQL primary with one streaming standby, for figure 10's replay lag (issue 44 item 6).
# The shared server's pg_hba allows no replication connection, so the bench runs against this pair:
#
#   bench/standby-cluster.sh start [dir] [port]   # primary on <port> (default 5544), standby on <port>+1
#   DATABASE_URL=postgres://postgres@127.0.0.1:5544/postgres npm run bench -- --only partitions
#   bench/standby-cluster.sh stop [dir]
#
# Both run as the postgres OS user (PostgreSQL refuses root) from the same binaries as the shared
# server; the figure reads the standby's replay_lag from the primary's pg_stat_replication.
set -eu
action=${1:?start or stop}
dir=${2:-/tmp/reaper-bench-standby}
port=${3:-5544}
bin=$(pg_config --bindir 2>/dev/null || echo /usr/lib/postgresql/15/bin)
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
case "$action" in
start)
  mkdir -p "$dir"
  [ "$(id -u)" = 0 ] && chown postgres "$dir"
  as_pg "$bin/initdb" -D "$dir/primary" -U postgres --auth=trust >/dev/null
  cat >>"$dir/primary/postgresql.conf" <<CONF
port = $port
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir'
wal_level = replica
max_wal_senders = 4
shared_buffers = 256MB
max_wal_size = 4GB
shared_preload_libraries = ''
CONF
  echo "host replication postgres 127.0.0.1/32 trust" >>"$dir/primary/pg_hba.conf"
  as_pg "$bin/pg_ctl" -D "$dir/primary" -l "$dir/primary.log" -w start >/dev/null
  as_pg "$bin/pg_basebackup" -h 127.0.0.1 -p "$port" -U postgres -D "$dir/standby" -R -X stream -c fast
  cat >>"$dir/standby/postgresql.conf" <<CONF
port = $((port + 1))
hot_standby = on
CONF
  as_pg "$bin/pg_ctl" -D "$dir/standby" -l "$dir/standby.log" -w start >/dev/null
  psql -h 127.0.0.1 -p "$port" -U postgres -Atc "SELECT 'standbys streaming: ' || count(*) FROM pg_stat_replication WHERE state = 'streaming'"
  ;;
stop)
  for node in standby primary; do [ -d "$dir/$node" ] && as_pg "$bin/pg_ctl" -D "$dir/$node" -m fast -w stop >/dev/null || true; done
  rm -rf "$dir"
  ;;
*) echo "usage: $0 start|stop [dir] [port]" >&2; exit 2 ;;
esac
