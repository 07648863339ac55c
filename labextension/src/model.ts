// The status this server's gpuhub extension answers (gpu_magics/lab/status.py), polled.
import { ServerConnection } from '@jupyterlab/services';
import { URLExt } from '@jupyterlab/coreutils';
import { Signal } from '@lumino/signaling';

export interface GpuView {
  label: string;
  node: string;
  index: number;
  model: string | null;
  utilization: number | null;
  memory_used_mib: number | null;
  memory_total_mib: number | null;
  history: [number, number][]; // [seconds before now, utilization]
}

// the broker's EnergyFigures (spawner/broker/openapi.yaml): what an allocation used so far
export interface EnergyFigures {
  gpu_kwh: number;
  idle_kwh: number;
  idle_share: number | null;
  meter_kwh: number;
  cost: number | null;
  currency: string | null;
  co2e_kg: number | null;
  measured_gpu_hours: number;
  unknown_gpu_hours: number;
  unknown_share: number | null;
}

// the facility's numbers and where energy is read (the broker's Costing)
export interface Costing {
  pue: number;
  price_per_kwh: number | null;
  currency: string | null;
  carbon_g_per_kwh: number | null;
  source: string;
}

export interface AllocationView {
  id: number;
  purpose: 'server' | 'distributed';
  state: string;
  gpu_count: number;
  slice_parts?: number | null; // a slice of a GPU split in this many parts (c.GpuHub.gpu_slices)
  nodes: string[];
  borrowed: number;
  idle: { state: string; reclaim_in_seconds: number | null; reason: string } | null;
  preemption: { due: string; reason: string } | null;
  time_limit: { ends: string; seconds: number; warned?: boolean } | null;
  gpus: GpuView[];
  energy?: EnergyFigures | null; // null: nothing measured yet
  energy_text?: string; // the figures in words (gpu_magics.kernel.energy.energy_text)
}

export interface QueueView {
  id: number;
  gpus: number;
  purpose: string;
  position: number;
  waiting: number;
  line: string | null;
}

export interface GpuEvent {
  key: string;
  kind: string;
  level: 'success' | 'warning' | 'error' | 'info';
  title: string;
  message: string;
  deadline: string | null;
  past: string | null; // what happened, said once the server is gone
  detail: string; // the broker's full words
}

export interface KernelPool {
  kernel_pid: number;
  bursts: number[];
  ranks: { rank: number; node: string; gpu: string; pid: number | null; state: string }[];
  autosave: { names: string[]; dir: string } | null;
}

export interface Status {
  available: boolean;
  reason?: string;
  user?: string;
  summary: { text: string; gpus?: number; utilization?: number | null; markers?: string[] };
  server?: AllocationView | null;
  pools?: AllocationView[];
  queue?: QueueView[];
  limit?: { max_gpus: number | null; gpu_hours: number | null; window_hours: number | null; source?: string };
  held?: number;
  may_take?: number | null;
  borrow?: { allowance: number | null; borrowed: number; may_borrow_now: number };
  gpu_hours_used?: number;
  energy?: Costing | null;
  history_seconds?: number;
  my_gpus?: string | null;
  kernel_pools?: KernelPool[];
  events: GpuEvent[];
}

const VISIBLE_MS = 3000; // while the page is seen
const HIDDEN_MS = 30000; // a tab in the background

export class GpuModel {
  readonly changed = new Signal<GpuModel, Status>(this);
  // the server could not be reached after it had answered: it stopped (or the network went)
  readonly lost = new Signal<GpuModel, Status | null>(this);
  status: Status | null = null;
  private settings = ServerConnection.makeSettings();
  private timer = 0;
  private gone = false;

  start(): void {
    void this.poll();
    document.addEventListener('visibilitychange', () => {
      if (!document.hidden) {
        void this.poll();
      }
    });
  }

  private url(path: string): string {
    return URLExt.join(this.settings.baseUrl, 'gpuhub/api', path);
  }

  async poll(): Promise<void> {
    window.clearTimeout(this.timer);
    try {
      const reply = await ServerConnection.makeRequest(this.url('status'), {}, this.settings);
      const kind = reply.headers.get('Content-Type') || '';
      if (!reply.ok || !kind.includes('json')) {
        throw new Error(`the server answered ${reply.status}`);
      }
      const status = (await reply.json()) as Status;
      this.gone = false;
      this.status = status;
      this.changed.emit(status);
    } catch (e) {
      if (!this.gone && this.status !== null) {
        this.gone = true;
        this.lost.emit(this.status);
      }
      const down: Status = {
        available: false,
        reason: `this server cannot be reached (${(e as Error).message})`,
        summary: { text: 'GPU status unavailable' },
        events: []
      };
      this.changed.emit(down);
    }
    this.timer = window.setTimeout(() => void this.poll(), document.hidden ? HIDDEN_MS : VISIBLE_MS);
  }

  private async act(path: string, method: string, body?: object): Promise<string | null> {
    const init = body === undefined ? { method } : { method, body: JSON.stringify(body) };
    const reply = await ServerConnection.makeRequest(this.url(path), init, this.settings);
    if (reply.ok) {
      void this.poll();
      return null;
    }
    try {
      return ((await reply.json()) as { message: string }).message;
    } catch {
      return `the server answered ${reply.status}`;
    }
  }

  release(allocationId: number): Promise<string | null> {
    return this.act(`allocations/${allocationId}/release`, 'POST');
  }

  extend(allocationId: number, hours: number): Promise<string | null> {
    return this.act(`allocations/${allocationId}/extend`, 'POST', { hours });
  }

  leave(entryId: number): Promise<string | null> {
    return this.act(`queue/${entryId}`, 'DELETE');
  }
}

export function gpuWord(n: number): string {
  return n === 1 ? '1 GPU' : `${n} GPUs`;
}

// as gpu_magics.kernel.energy.energy_text (and spawner.policy.energy.describe): one line
export function energyText(f: EnergyFigures | null | undefined, pue?: number | null): string {
  if (!f) {
    return 'not measured yet';
  }
  let text = `${f.gpu_kwh.toFixed(3)} kWh at the GPUs`;
  const extra: string[] = [];
  if (pue != null ? pue !== 1 : f.meter_kwh !== f.gpu_kwh) {
    extra.push(`${f.meter_kwh.toFixed(3)} kWh at the meter`);
  }
  if (f.cost != null) {
    extra.push(`${f.cost.toFixed(2)} ${f.currency ?? ''}`.trim());
  }
  if (f.co2e_kg != null) {
    extra.push(`${f.co2e_kg.toFixed(3)} kg CO2e`);
  }
  if (extra.length) {
    text += ` (${extra.join(', ')})`;
  }
  if (f.idle_share != null) {
    text += `; ${(f.idle_share * 100).toFixed(0)} % of it idle`;
  }
  if (f.unknown_gpu_hours > 0) {
    text += `; ${f.unknown_gpu_hours.toFixed(2)} GPU-hours not measured`;
  }
  return text;
}

export function untilText(deadline: string, now: number = Date.now()): string {
  const s = Math.max(0, Math.round((Date.parse(deadline) - now) / 1000));
  if (s >= 3600) {
    return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  }
  return s >= 60 ? `${Math.floor(s / 60)} min ${s % 60} s` : `${s} s`;
}
