import { LabIcon } from '@jupyterlab/ui-components';

// a GPU board: the side bar's tab of the GPU panel
export const gpuIcon = new LabIcon({
  name: 'gpuhub:gpu',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16"><g class="jp-icon3" fill="#616161">' +
    '<path d="M2 6h18v12H2zM4 8v8h14V8z"/><rect x="6" y="10" width="4" height="4"/><rect x="12" y="10" width="4" height="4"/>' +
    '<path d="M20 9h2v2h-2zM20 13h2v2h-2zM5 18h2v2H5zM9 18h2v2H9zM13 18h2v2h-2z"/></g></svg>'
});
