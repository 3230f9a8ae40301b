"""The dashboard's pages: one folder per page (``dashboard/pages/<page>/``).

Each page's ``__init__.py`` has ``register(app)``, which calls ``dash.register_page`` (its path, name,
title and order, its ``layout`` function) and registers the page's callbacks on ``app``; the page's
other modules are ``layout.py`` (the skeleton, component ids prefixed by the page), ``callbacks.py``
(thin: fetch through :func:`dashboard.context.open_client`, build, return; each declared with
``@callback(...)`` on the module's :class:`dashboard.registry.CallbackSet`) and, as the page needs,
``figures.py`` (or ``figures/``) and ``tables.py``: pure builders from wire-schema objects.

:func:`dashboard.app.create_dash_app` registers every page of :data:`dashboard.app.PAGES`; Dash does
not walk this folder (``pages_folder=""``). So importing a page's helper module (a test does) registers
nothing, and each app gets its pages' callbacks exactly once, however many apps the process builds.
"""
