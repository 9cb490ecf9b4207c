"""`perdure web`: a read-only viewer of a workspace's runs (table, curves, run pages, images) in a browser.

Nothing here imports the web library but `app.py` and `server.py`, so the data side (`workspace_view.py`) works
without the `web` extra.
"""
