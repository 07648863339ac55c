// The status bar item: this server's GPUs, their use now, markers; a click opens the panel.
import { Widget } from '@lumino/widgets';
import { GpuModel, Status } from './model';

export class GpuStatusItem extends Widget {
  constructor(model: GpuModel, open: () => void) {
    super();
    this.addClass('gpuhub-status');
    this.node.title = 'gpuhub: this server’s GPUs (click for the GPU panel)';
    this.node.textContent = 'GPUs …';
    this.node.addEventListener('click', open);
    model.changed.connect((_, status) => this.render(status));
  }

  private render(status: Status): void {
    this.node.textContent = status.available ? `GPUs: ${status.summary.text}` : 'GPU status unavailable';
    this.node.dataset.available = String(status.available);
    this.node.title = status.available
      ? 'gpuhub: this server’s GPUs (click for the GPU panel)'
      : `GPU status unavailable: ${status.reason ?? ''}`;
    this.toggleClass('gpuhub-warn', (status.events ?? []).some(e => e.deadline !== null));
  }
}
