/* Cell renderers of the dashboard's AG Grids (dash-ag-grid looks them up by name in
   window.dashAgGridComponentFunctions). Rows are built in Python (dashboard/fleet.py); these only draw:
   VigilLink: the node id, linking to the node's page (row field "href");
   VigilBar:  a percentage as a bar with its value, "n/a" for null;
   VigilRate: a rate's text (row field named by cellRendererParams.textField) and, when
              cellRendererParams.histField names a list of numbers, a sparkline of it. */
(function () {
  var funcs = (window.dashAgGridComponentFunctions = window.dashAgGridComponentFunctions || {});
  var h = function () { return window.React.createElement.apply(null, arguments); };

  funcs.VigilLink = function (props) {
    if (!props.data) { return props.value; }
    return h('a', {href: props.data.href, className: 'vigil-node-link'}, props.value);
  };

  funcs.VigilBar = function (props) {
    var v = props.value;
    if (v === null || v === undefined || isNaN(v)) {
      return h('span', {className: 'vigil-na text-muted'}, 'n/a');
    }
    var pct = Math.max(0, Math.min(100, v));
    var color = pct >= 90 ? '#d62728' : (pct >= 75 ? '#ff7f0e' : '#4c9be8');
    return h('div', {className: 'vigil-bar'},
      h('div', {className: 'vigil-bar-fill', style: {width: pct + '%', background: color}}),
      h('span', {className: 'vigil-bar-label'}, Number(v).toFixed(1) + '%'));
  };

  function sparkline(values, width, height) {
    var known = values.filter(function (v) { return v !== null && v !== undefined && !isNaN(v); });
    if (values.length < 2 || known.length < 2) { return null; }
    var max = Math.max.apply(null, known.concat([1e-9]));
    var min = Math.min.apply(null, known.concat([0]));
    var step = width / (values.length - 1);
    var segments = [], current = [];
    values.forEach(function (v, i) {
      if (v === null || v === undefined || isNaN(v)) {
        if (current.length) { segments.push(current); current = []; }
        return;
      }
      var y = height - 1 - ((v - min) / (max - min || 1)) * (height - 2);
      current.push((i * step).toFixed(1) + ',' + y.toFixed(1));
    });
    if (current.length) { segments.push(current); }
    return h('svg', {className: 'vigil-spark', width: width, height: height, viewBox: '0 0 ' + width + ' ' + height},
      segments.map(function (pts, k) {
        return h('polyline', {key: k, points: pts.join(' '), fill: 'none', stroke: '#4c9be8', strokeWidth: 1.5});
      }));
  }

  funcs.VigilRate = function (props) {
    var data = props.data || {};
    var text = props.textField ? data[props.textField] : props.value;
    var hist = props.histField ? (data[props.histField] || []) : [];
    return h('span', {className: 'vigil-rate'},
      h('span', {className: 'vigil-rate-text'}, text === null || text === undefined ? 'n/a' : text),
      sparkline(hist, 60, 18));
  };
})();
