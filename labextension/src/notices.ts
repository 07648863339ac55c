// gpuhub's notices as JupyterLab notifications: each event once (remembered across this
// browser's tabs), a deadline counting down, and why the server stopped when it goes.
import { Notification } from '@jupyterlab/apputils';
import { GpuEvent, GpuModel, Status, untilText } from './model';

const STORE = 'gpuhub-lab:shown';
const DEADLINE_KINDS = new Set(['preemption', 'idle', 'time']);

function text(e: GpuEvent): string {
  const when = e.deadline === null ? '' : ` in ${untilText(e.deadline)}`;
  return `${e.title}${when}. ${e.message}`;
}

export class Notifier {
  private live = new Map<string, { id: string; event: GpuEvent }>();
  private last: Status | null = null;

  constructor(model: GpuModel) {
    model.changed.connect((_, status) => this.update(status));
    model.lost.connect((_, last) => this.stopped(last));
    window.setInterval(() => this.tick(), 1000);
  }

  private shown(): Set<string> {
    try {
      return new Set(JSON.parse(window.localStorage.getItem(STORE) ?? '[]') as string[]);
    } catch {
      return new Set();
    }
  }

  private remember(keys: Set<string>): void {
    window.localStorage.setItem(STORE, JSON.stringify([...keys].slice(-200)));
  }

  private update(status: Status): void {
    if (!status.available) {
      return;
    }
    this.last = status;
    const shown = this.shown();
    const current = new Set(status.events.map(e => e.key));
    for (const e of status.events) {
      if (shown.has(e.key)) {
        continue;
      }
      shown.add(e.key);
      const options = { autoClose: e.deadline === null && e.level === 'success' ? 10000 : (false as const) };
      const id = Notification.emit(text(e), e.level, options);
      this.live.set(e.key, { id, event: e });
    }
    // an event no longer current (withdrawn, used again, extended) is forgotten: a new one shows
    for (const key of [...shown]) {
      if (!current.has(key)) {
        shown.delete(key);
      }
    }
    for (const [key, { id }] of this.live) {
      if (!current.has(key)) {
        Notification.dismiss(id);
        this.live.delete(key);
      }
    }
    this.remember(shown);
  }

  private tick(): void {
    for (const { id, event } of this.live.values()) {
      if (event.deadline !== null) {
        Notification.update({ id, message: text(event) });
      }
    }
  }

  private stopped(last: Status | null): void {
    const events = (last ?? this.last)?.events ?? [];
    const soon = Date.now() + 10000;
    const cause =
      events.find(e => DEADLINE_KINDS.has(e.kind) && e.deadline !== null && Date.parse(e.deadline) <= soon) ??
      events.find(e => e.kind === 'preempted' || e.kind === 'reclaimed');
    const saved = ((last ?? this.last)?.kernel_pools ?? [])
      .filter(p => p.autosave !== null)
      .map(p => `--autosave was set to save ${p.autosave!.names.join(', ')} to ${p.autosave!.dir} (unchecked here: the cell says what was saved)`);
    const why =
      (cause?.past
        ? `This server stopped: ${cause.past}.`
        : 'This server stopped, or cannot be reached; gpuhub gave no notice that this page saw.') +
      (saved.length ? ` ${saved.join('; ')}.` : '');
    const myGpus = (last ?? this.last)?.my_gpus;
    Notification.error(why, {
      autoClose: false,
      actions: myGpus ? [{ label: 'My GPUs', callback: () => window.open(myGpus, '_blank') }] : []
    });
    for (const { id } of this.live.values()) {
      Notification.dismiss(id);
    }
    this.live.clear();
  }
}
