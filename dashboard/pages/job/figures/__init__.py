"""The job page's figures, one module per tab (``training``, ``ranks``, ``breakdown``, ``collectives``,
``recovery``), pure functions from the controller's views to Plotly figures; ``overview`` draws or
extends (``dash.Patch``) the figures refreshed every tick, from their declarations in ``training`` and
``ranks`` (:class:`dashboard.figures.series.LineFigure`).
"""
