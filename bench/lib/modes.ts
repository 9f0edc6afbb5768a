/**
 * How big each mode measures. quick: the whole picture in under three minutes, plus about ten for figure 7b's shapes. full: the sizes the
 * README reports. smoke: CI, small enough for a minute; it checks counts, and its speeds mean nothing.
 */
import type { ForegroundOptions } from '../figures/foreground';
import type { ShapesOptions } from '../figures/shapes';

export type Mode = 'smoke' | 'quick' | 'full';

export interface ModeConfig {
  mode: Mode;
  /** Candidates (expired held rows) per seed; each seed also holds as many rows that must survive. */
  sizes: number[];
  batchSize: number;
  /** Rounds of figure 1's contenders, taken in turns; each reports its fastest. */
  repeats: number;
  /** pg-boss one job per row runs on the first this-many candidates of the first seed. */
  rowJobRows: number;
  /** Raw DELETE with 4 clients as well (the issue quotes it). */
  rawFourClients: boolean;
  /** Scheduler memory is also measured for a run of this many candidates (taken from the first seed). */
  schedulerMemoryAt: number | null;
  sweep: { batchSizes: number[] } | null;
  latency: { rows: number; spreadSeconds: number; schedule: string; tickSeconds: number };
  remote: { ratePerSecond: number; burst: number; concurrency: number; backlogSeconds: number; slowMs: number; workers: number };
  /** Issue 7 item 10: a backlog drained over many scheduled runs (full mode only: it takes about 200 s). */
  remoteBacklog: { assets: number; ratePerSecond: number; burst: number; concurrency: number; workers: number; runEverySeconds: number; slowMs: number } | null;
  /**
   * Figure 7 (issue 12): a fixed pgbench foreground next to each cleanup of the first seed. Smoke
   * runs the cleanups without pgbench and checks their counts only.
   */
  foreground: ForegroundOptions;
  /**
   * Figure 7b (issue 41): four foreground shapes, each with a sweep of fixed rates, unthrottled and
   * adaptive reaper (bench/figures/shapes.ts). Null in smoke: CI checks counts, and this figure is
   * about latency only (its counts are checked in quick and full).
   */
  shapes: ShapesOptions | null;
  /** Longest any one contender may run before its figure is reported as bounded. */
  boundMs: number;
}

const LATENCY_TICK = { schedule: '*/2 * * * * *', tickSeconds: 2 };
/** 300 statements/s on 4 connections; reaper at its default batch size; the throttle at a stated 5,000 rows/s, one statement at a time. */
const FOREGROUND: ForegroundOptions = {
  foreground: true,
  ratePerSecond: 300,
  quietRatePerSecond: 30,
  clients: 4,
  baselineSeconds: 4,
  reaperBatchSize: 500,
  throttle: { rowsPerSecond: 5_000, concurrency: 1 },
  loopBatchSize: 1000,
  rows: 50_000,
};
/**
 * Figure 7b's sweep. quick: the long window is 5 s from at most 3 s after the trigger (steady
 * enough for a fixed rate; the adaptive law's first steps are 250 ms apart), on runs sized for it:
 * 570k candidates a shape. full: 20 s from 5 s.
 */
const SHAPES_SWEEP = { batchSize: 500, rates: [500, 1_000, 2_000, 4_000, 8_000, 16_000], shortRows: 15_000, kneeRatio: 1.25 };
const REMOTE = { ratePerSecond: 200, burst: 20, concurrency: 16, slowMs: 20, workers: 3 };

export const MODES: Record<Mode, ModeConfig> = {
  smoke: {
    mode: 'smoke',
    sizes: [20_000],
    batchSize: 100,
    repeats: 1,
    rowJobRows: 2_000,
    rawFourClients: false,
    schedulerMemoryAt: null,
    sweep: null,
    latency: { rows: 200, spreadSeconds: 3, ...LATENCY_TICK },
    remote: { ...REMOTE, backlogSeconds: 2 },
    remoteBacklog: null,
    foreground: { ...FOREGROUND, foreground: false, rows: 10_000, throttle: { rowsPerSecond: 20_000, concurrency: 1 } },
    shapes: null,
    boundMs: 45_000,
  },
  quick: {
    mode: 'quick',
    sizes: [200_000],
    batchSize: 100,
    repeats: 2,
    rowJobRows: 10_000,
    rawFourClients: false,
    schedulerMemoryAt: null,
    sweep: { batchSizes: [50, 100, 500, 1000] },
    latency: { rows: 1_000, spreadSeconds: 6, ...LATENCY_TICK },
    remote: { ...REMOTE, backlogSeconds: 10 },
    remoteBacklog: null,
    foreground: FOREGROUND,
    shapes: { ...SHAPES_SWEEP, candidates: 570_000, aloneSeconds: 2, shortSeconds: 4, longFromSeconds: 3, longSeconds: 5, maxRunRows: 150_000, adaptiveRows: 100_000 },
    boundMs: 60_000,
  },
  full: {
    mode: 'full',
    sizes: [500_000, 2_000_000],
    batchSize: 100,
    repeats: 3,
    rowJobRows: 20_000,
    rawFourClients: true,
    schedulerMemoryAt: 200_000,
    sweep: { batchSizes: [50, 100, 500, 1000] },
    latency: { rows: 2_000, spreadSeconds: 10, ...LATENCY_TICK },
    remote: { ...REMOTE, backlogSeconds: 10 },
    remoteBacklog: { assets: 20_000, ratePerSecond: 100, burst: 20, concurrency: 16, workers: 3, runEverySeconds: 10, slowMs: 20 },
    foreground: { ...FOREGROUND, baselineSeconds: 8, rows: 100_000 },
    shapes: { ...SHAPES_SWEEP, candidates: 2_000_000, aloneSeconds: 5, shortSeconds: 10, longFromSeconds: 5, longSeconds: 20, maxRunRows: 500_000, adaptiveRows: 300_000 },
    boundMs: 300_000,
  },
};
