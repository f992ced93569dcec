"""The lab web page: `GET /lab` on `servelab serve` or `servelab lab web`, and its JSON API under /lab/api."""
