"""Vigil's Plotly Dash dashboard; reads the controller's REST API only (see :mod:`dashboard.app`)."""
