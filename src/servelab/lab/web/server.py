"""`servelab lab web`: the lab page and its API alone, with no model loaded (for machines that cannot run
one). The same router as `servelab serve` mounts."""
from __future__ import annotations

import uvicorn
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from servelab.errors import OpenAIError
from servelab.lab.web.routes import build_lab_router


def build_lab_app() -> FastAPI:
    app = FastAPI(title="servelab lab")
    app.include_router(build_lab_router(live_engine=None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error = OpenAIError(exc.status_code, str(exc.detail))
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.get("/")
    async def root() -> Response:
        return RedirectResponse("/lab")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


class LabServer(uvicorn.Server):
    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
            port = next((s.getsockname()[1] for server in self.servers for s in server.sockets), self.config.port)
            print(f"servelab lab: the lab page is at http://{host}:{port}/lab (no model loaded; Ctrl+C to stop)",
                  flush=True)


def serve_lab(host: str, port: int) -> int:
    LabServer(uvicorn.Config(build_lab_app(), host=host, port=port, log_level="warning", access_log=False)).run()
    return 0


def add_web_parser(lab_commands) -> None:
    """`servelab lab web`, added by the entry point beside the lab's own commands."""
    web = lab_commands.add_parser("web", help="serve the lab page and its API alone, without loading a model")
    web.add_argument("--host", default="127.0.0.1")
    web.add_argument("--port", type=int, default=8000, help="0: any free port (the banner prints it)")
    web.set_defaults(func=lambda args: serve_lab(args.host, args.port))
