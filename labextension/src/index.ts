// gpuhub in JupyterLab: this server's GPUs in the status bar, a GPU panel, and notifications.
import { ILabShell, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { IStatusBar } from '@jupyterlab/statusbar';
import { gpuIcon } from './icon';
import { GpuModel } from './model';
import { Notifier } from './notices';
import { GpuPanel } from './panel';
import { GpuStatusItem } from './statusbar';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'gpuhub-lab:plugin',
  description: 'This server’s GPUs, their live use, the queue and gpuhub’s notices.',
  autoStart: true,
  optional: [IStatusBar, ILabShell],
  activate: (app: JupyterFrontEnd, statusBar: IStatusBar | null) => {
    const model = new GpuModel();
    const panel = new GpuPanel(model);
    panel.id = 'gpuhub-gpu-panel';
    panel.title.icon = gpuIcon;
    panel.title.caption = 'GPUs (gpuhub)';
    app.shell.add(panel, 'right', { rank: 900 });
    if (statusBar) {
      const item = new GpuStatusItem(model, () => app.shell.activateById(panel.id));
      statusBar.registerStatusItem('gpuhub-lab:status', { item, align: 'left', rank: 50 });
    }
    new Notifier(model);
    model.start();
  }
};

export default plugin;
