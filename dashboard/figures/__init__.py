"""The dashboard's figure layer, shared by every page: the empty figure, the common layout and the graph
component (:mod:`dashboard.figures.base`), and figures declared once as lines against step that give
both the whole figure and the ``dash.Patch`` that extends it (:mod:`dashboard.figures.series`).

A page's own figures live in its folder (``dashboard/pages/<page>/figures.py`` or ``figures/``), built
by pure functions from wire-schema objects, unit-tested without a browser.
"""
