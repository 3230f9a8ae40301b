"""Dash pages of the dashboard: one module per page, imported by Dash (``use_pages=True``).

Each module calls ``dash.register_page`` at import, so import them only through
:func:`dashboard.app.create_dash_app`, never directly.
"""
