// The GPU panel: per GPU of this server and of its pools, live use over the last minutes
// (Chart.js, bundled), the limit and what may still be taken or borrowed, the queue, actions.
import { Widget } from '@lumino/widgets';
import {
  CategoryScale,
  Chart,
  Filler,
  LinearScale,
  LineController,
  LineElement,
  PointElement
} from 'chart.js';
import { AllocationView, GpuModel, GpuView, Status, energyText, gpuWord, untilText } from './model';

Chart.register(LineController, LineElement, PointElement, LinearScale, CategoryScale, Filler);

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  attrs: Record<string, string> = {},
  ...children: (Node | string)[]
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    node.setAttribute(k, v);
  }
  node.append(...children);
  return node;
}

function memoryText(g: GpuView): string {
  if (g.memory_used_mib === null) {
    return 'no reading';
  }
  return `${g.memory_used_mib} / ${g.memory_total_mib ?? '?'} MiB`;
}

export class GpuPanel extends Widget {
  private charts = new Map<string, Chart>();
  private body = el('div', { class: 'gpuhub-panel-body' });
  private note = el('div', { class: 'gpuhub-panel-note' });

  constructor(private model: GpuModel) {
    super();
    this.addClass('gpuhub-panel');
    this.node.append(el('h2', {}, 'GPUs'), this.note, this.body);
    model.changed.connect((_, status) => this.render(status));
  }

  private render(status: Status): void {
    this.note.textContent = '';
    if (!status.available) {
      this.note.textContent = `GPU status unavailable: ${status.reason ?? ''}`;
      return;
    }
    const seen = new Set<string>();
    const parts: Node[] = [this.limits(status)];
    for (const e of status.events) {
      const when = e.deadline === null ? '' : ` (in ${untilText(e.deadline)})`;
      parts.push(
        el('div', { class: `gpuhub-event gpuhub-${e.level}`, 'data-key': e.key }, el('strong', {}, `${e.title}${when}`), el('div', {}, e.detail || e.message))
      );
    }
    if (status.server) {
      parts.push(this.allocation('This server', status.server, seen, false, status));
    } else {
      parts.push(el('p', { class: 'gpuhub-none' }, 'This server holds no GPUs.'));
    }
    for (const pool of status.pools ?? []) {
      parts.push(this.allocation(`%%distributed burst #${pool.id}`, pool, seen, true, status));
    }
    for (const p of status.kernel_pools ?? []) {
      const rows = p.ranks.map(r =>
        el('tr', { 'data-rank': String(r.rank), 'data-state': r.state }, ...[String(r.rank), r.node, r.gpu, String(r.pid ?? ''), r.state].map(t => el('td', {}, t)))
      );
      const table = el('table', { class: 'gpuhub-ranks' }, el('tr', {}, ...['rank', 'node', 'GPU', 'pid', 'state'].map(t => el('th', {}, t))), ...rows);
      const box = el('div', { class: 'gpuhub-pool', 'data-kernel': String(p.kernel_pid) }, el('strong', {}, `%%distributed pool: ${p.ranks.length} ranks`), table);
      if (p.autosave) {
        box.append(el('div', { class: 'gpuhub-autosave' }, `--autosave: ${p.autosave.names.join(', ')} to ${p.autosave.dir}`));
      }
      parts.push(box);
    }
    for (const q of status.queue ?? []) {
      const leave = el('button', { class: 'jp-mod-styled gpuhub-leave', 'data-entry': String(q.id) }, 'Leave the queue');
      leave.addEventListener('click', () => void this.act(this.model.leave(q.id)));
      parts.push(
        el(
          'div',
          { class: 'gpuhub-queue', 'data-entry': String(q.id) },
          el('strong', {}, `Waiting for ${gpuWord(q.gpus)}: ${q.position} of ${q.waiting}`),
          el('div', {}, q.line ?? ''),
          leave
        )
      );
    }
    if (status.my_gpus) {
      parts.push(el('p', {}, el('a', { href: status.my_gpus, target: '_blank', class: 'gpuhub-my-gpus' }, 'Open My GPUs')));
    }
    for (const [label, chart] of this.charts) {
      if (!seen.has(label)) {
        chart.destroy();
        this.charts.delete(label);
      }
    }
    this.body.replaceChildren(...parts);
  }

  private limits(s: Status): HTMLElement {
    const l = s.limit;
    const words = [
      l?.max_gpus == null ? 'no GPU limit' : `limit ${gpuWord(l.max_gpus)}${l.source ? ` (${l.source})` : ''}`,
      `holding ${gpuWord(s.held ?? 0)}`
    ];
    if (s.may_take != null) {
      words.push(`may take ${s.may_take} more`);
    }
    if (s.borrow && s.borrow.may_borrow_now > 0) {
      words.push(`may borrow ${s.borrow.may_borrow_now} now`);
    }
    const hours = `${(s.gpu_hours_used ?? 0).toFixed(2)} GPU-hours used`;
    const budget = l?.gpu_hours != null ? `${hours} of ${l.gpu_hours} in ${l.window_hours} h` : hours;
    return el('div', { class: 'gpuhub-limits' }, words.join(' · '), el('br'), budget);
  }

  private allocation(title: string, a: AllocationView, seen: Set<string>, burst: boolean, s: Status): HTMLElement {
    const amount = a.slice_parts ? `a 1/${a.slice_parts} GPU slice` : gpuWord(a.gpu_count);
    const head = el('div', { class: 'gpuhub-alloc-head' }, el('strong', {}, `${title}: ${amount}`));
    if (a.borrowed) {
      head.append(el('span', { class: 'gpuhub-badge gpuhub-borrowed' }, `${a.borrowed} borrowed`));
    }
    const box = el('div', { class: 'gpuhub-alloc', 'data-allocation': String(a.id), 'data-purpose': a.purpose }, head);
    if (a.preemption) {
      box.append(el('div', { class: 'gpuhub-alert' }, `Taken back in ${untilText(a.preemption.due)}: ${a.preemption.reason}`));
    }
    if (a.time_limit) {
      const extend = el('button', { class: 'jp-mod-styled gpuhub-extend', 'data-allocation': String(a.id) }, 'Extend by 1 h');
      extend.addEventListener('click', () => void this.act(this.model.extend(a.id, 1)));
      box.append(el('div', { class: 'gpuhub-time' }, `Time limit ends in ${untilText(a.time_limit.ends)} `, extend));
    }
    if (a.idle && a.idle.state === 'warned' && a.idle.reclaim_in_seconds !== null) {
      box.append(el('div', { class: 'gpuhub-alert' }, `Idle: taken back in ${Math.round(a.idle.reclaim_in_seconds)} s unless used`));
    }
    for (const g of a.gpus) {
      seen.add(g.label);
      box.append(this.gpu(g));
    }
    box.append(this.energy(a, s));
    if (burst) {
      const release = el('button', { class: 'jp-mod-styled gpuhub-release', 'data-allocation': String(a.id) }, 'Release');
      release.addEventListener('click', () => void this.act(this.model.release(a.id)));
      box.append(release);
    }
    return box;
  }

  // what the allocation used so far, from gpuhub's own readings of its GPUs
  private energy(a: AllocationView, s: Status): HTMLElement {
    const f = a.energy ?? null;
    const line = el(
      'div',
      { class: 'gpuhub-energy', 'data-allocation': String(a.id), 'data-gpu-kwh': f === null ? '' : String(f.gpu_kwh) },
      `Energy so far: ${a.energy_text ?? energyText(f, s.energy?.pue)}`
    );
    if (s.energy?.source) {
      line.title = `From ${s.energy.source}.`;
    }
    return line;
  }

  private gpu(g: GpuView): HTMLElement {
    const util = g.utilization === null ? 'no reading' : `${Math.round(g.utilization)} %`;
    const row = el(
      'div',
      {
        class: 'gpuhub-gpu',
        'data-gpu': g.label,
        'data-utilization': g.utilization === null ? '' : String(g.utilization),
        'data-memory': g.memory_used_mib === null ? '' : String(g.memory_used_mib)
      },
      el('div', {}, el('strong', {}, g.label), ` ${g.model ?? ''}`),
      el('div', { class: 'gpuhub-gpu-use' }, `${util} · ${memoryText(g)}`)
    );
    let chart = this.charts.get(g.label);
    const data = g.history.map(([t, u]) => ({ x: t, y: u }));
    if (chart === undefined) {
      const canvas = el('canvas', { class: 'gpuhub-chart', width: '240', height: '60' });
      chart = new Chart(canvas, {
        type: 'line',
        data: { datasets: [{ data, borderColor: '#1976d2', backgroundColor: 'rgba(25,118,210,0.15)', fill: true, pointRadius: 0, borderWidth: 1.5 }] },
        options: {
          animation: false,
          responsive: false,
          parsing: false,
          scales: { x: { type: 'linear', display: false }, y: { min: 0, max: 100, ticks: { stepSize: 50 } } },
          plugins: { legend: { display: false } }
        }
      });
      this.charts.set(g.label, chart);
    } else {
      chart.data.datasets[0].data = data;
      chart.update('none');
    }
    const canvas = chart.canvas;
    canvas.dataset.points = String(data.length);
    canvas.dataset.max = data.length ? String(Math.max(...data.map(p => p.y))) : '';
    row.append(canvas);
    return row;
  }

  private async act(done: Promise<string | null>): Promise<void> {
    const problem = await done;
    this.note.textContent = problem ?? '';
  }
}
