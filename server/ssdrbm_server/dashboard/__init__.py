"""The live dashboard: the jobs list and each job's curves in a browser, served by the HTTP
front under ``/dashboard`` (server.py), from files shipped in this package (static/): plain
HTML, one script and one style sheet, no build step and nothing fetched from elsewhere."""

from ssdrbm_server.dashboard.server import dashboard_app

__all__ = ["dashboard_app"]
