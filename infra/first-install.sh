#!/usr/bin/env bash
# A first install of reaper, in the order docs/deploying.md "First install, in order" gives, against
# one PostgreSQL database and one RabbitMQ: the database roles as `reaper roles --print` prints them,
# `reaper migrate` as the migrator, the scheduler and a worker as their own roles until both are
# ready, `reaper doctor` as the operator, then the services are stopped. CI runs it against the
# local servers (test/integration/first-install.test.ts); on Kubernetes the same steps are the
# roles SQL, the migrate Job and the Deployments. The broker users `<REAPER_AMQP_PREFIX>-scheduler`...
# come from the deployment's definitions import (docs/deploying.md), not from this script; doctor
# checks their permissions and names any that are missing.
#
#   ADMIN_DATABASE_URL   a superuser (or the owner of the policies' tables) on the database to install into
#   AMQP_URL             the broker
#   REAPER_POLICIES      the policies file
#   REAPER_AMQP_PREFIX   broker name prefix (default: reaper)
#   REAPER_ROLE_PREFIX   role names <prefix>_migrator, _scheduler, _worker, _operator (default: reaper)
#   REAPER_LOG_DIR       where the services' logs go (default: a new temporary directory)
#
# Local trust authentication is assumed (no passwords in the URLs it makes); with passwords, set
# them after step 1 (ALTER ROLE ... PASSWORD) and run the steps by hand with each role's URL.
set -euo pipefail

: "${ADMIN_DATABASE_URL:?set ADMIN_DATABASE_URL: a superuser on the database to install into}"
: "${AMQP_URL:?set AMQP_URL: the broker}"
: "${REAPER_POLICIES:?set REAPER_POLICIES: the policies file}"
export AMQP_URL REAPER_POLICIES
export REAPER_AMQP_PREFIX="${REAPER_AMQP_PREFIX:-reaper}"
role_prefix="${REAPER_ROLE_PREFIX:-reaper}"
log_dir="${REAPER_LOG_DIR:-$(mktemp -d)}"
mkdir -p "$log_dir"
reaper="$(cd "$(dirname "$0")/.." && pwd)/bin/reaper"
migrator="${role_prefix}_migrator" scheduler="${role_prefix}_scheduler" worker="${role_prefix}_worker" operator="${role_prefix}_operator"
roles=(--scheduler "$scheduler" --worker "$worker" --operator "$operator")

# The admin URL with another user and no password (trust authentication).
url_as() { node -e 'const u = new URL(process.argv[1]); u.username = process.argv[2]; u.password = ""; console.log(u.href)' "$ADMIN_DATABASE_URL" "$1"; }
step() { echo "== step $1: $2"; }

step 1 "database roles (reaper roles --print, applied as ${ADMIN_DATABASE_URL%%@*}@…)"
"$reaper" roles --print --policies "$REAPER_POLICIES" --migrator "$migrator" "${roles[@]}" | psql "$ADMIN_DATABASE_URL" -v ON_ERROR_STOP=1 -q

step 2 "reaper migrate, as $migrator"
DATABASE_URL="$(url_as "$migrator")" "$reaper" migrate "${roles[@]}"

step 3 "the scheduler as $scheduler and a worker as $worker, until both are ready"
pids=()
stop_services() { for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done; }
trap stop_services EXIT
start_service() { # <service> <role> <http port>
  DATABASE_URL="$(url_as "$2")" HTTP_PORT="$3" "$reaper" "$1" >"$log_dir/$1.log" 2>&1 &
  pids+=("$!")
}
ready() { node -e 'fetch(`http://127.0.0.1:${process.argv[1]}/readyz`).then((r) => process.exit(r.ok ? 0 : 1), () => process.exit(1))' "$1"; }
ports=($(node -e 'const net = require("net"); const take = () => new Promise((r) => { const s = net.createServer().listen(0, "127.0.0.1", () => { const p = s.address().port; s.close(() => r(p)); }); }); Promise.all([take(), take()]).then((p) => console.log(p.join(" ")))'))
start_service scheduler "$scheduler" "${ports[0]}"
start_service worker "$worker" "${ports[1]}"
for service_port in "scheduler:${ports[0]}" "worker:${ports[1]}"; do
  service="${service_port%%:*}" port="${service_port##*:}"
  deadline=$((SECONDS + 60))
  until ready "$port"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "reaper first install: the $service is not ready after 60 s; its log ($log_dir/$service.log) ends:" >&2
      tail -n 20 "$log_dir/$service.log" >&2
      exit 1
    fi
    sleep 0.5
  done
  echo "   $service ready (port $port, log $log_dir/$service.log)"
done

step 4 "reaper doctor, as $operator"
DATABASE_URL="$(url_as "$operator")" "$reaper" doctor "${roles[@]}"

step 5 "stop the services"
trap - EXIT
status=0
for pid in "${pids[@]}"; do
  kill -TERM "$pid"
  wait "$pid" || status=$?
done
[ "$status" -eq 0 ] || { echo "reaper first install: a service exited with $status on SIGTERM (logs in $log_dir)" >&2; exit 1; }
echo "reaper first install: done (logs in $log_dir)"
