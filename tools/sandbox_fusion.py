"""Sandbox Fusion's `/run_code` on a `SandboxPool`: its request and answer shapes, an HTTP front.

`run_code` / `run_code_sync` accept and return Sandbox Fusion's `/run_code` JSON shapes;
`make_http_server` serves them on POST /run_code, so verl's SandboxFusionTool can use our pool.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import ipaddress
import json
import logging

from jaxrl_tools.tools.pool import SandboxPool

logger = logging.getLogger(__name__)

DEFAULT_HTTP_HOST = "127.0.0.1"  # the /run_code front has no authentication


async def run_code(request: dict, pool: SandboxPool) -> dict:
    """Sandbox Fusion `/run_code` on our pool.

    Args:
      request: {"code", "language" ("python"/"python3"), "run_timeout" (s), "memory_limit_MB",
        "stdin", "files" ({path: base64}), "compile_timeout" (ignored)}.
      pool: the SandboxPool to run on.

    Returns:
      {"status": "Success"|"Failed"|"SandboxError", "message", "compile_result": None,
       "run_result": {"status": "Finished"|"Error"|"TimeLimitExceeded", "execution_time",
       "return_code", "stdout", "stderr"}, "executor_pod_name": None, "files": {}}
    """
    lang = str(request.get("language", "python")).lower()
    if lang not in ("python", "python3"):
        return {
            "status": "SandboxError",
            "message": f"unsupported language {lang!r} (python only)",
            "compile_result": None,
            "run_result": None,
            "executor_pod_name": None,
            "files": {},
        }
    code = request.get("code")
    if not isinstance(code, str):
        return {
            "status": "SandboxError",
            "message": "field 'code' must be a string",
            "compile_result": None,
            "run_result": None,
            "executor_pod_name": None,
            "files": {},
        }
    try:
        files = {k: base64.b64decode(v) for k, v in (request.get("files") or {}).items()}
    except (ValueError, TypeError) as e:
        return {
            "status": "SandboxError",
            "message": f"field 'files': {e}",
            "compile_result": None,
            "run_result": None,
            "executor_pod_name": None,
            "files": {},
        }
    res = await pool.run(
        code,
        timeout_s=request.get("run_timeout"),
        memory_mb=request.get("memory_limit_MB"),
        stdin=request.get("stdin") or "",
        files=files,
    )
    if res.status == "SandboxError":
        return {
            "status": "SandboxError",
            "message": res.stderr,
            "compile_result": None,
            "run_result": None,
            "executor_pod_name": None,
            "files": {},
        }
    return {
        "status": "Success" if res.ok else "Failed",
        "message": "",
        "compile_result": None,
        "run_result": {
            "status": res.status,
            "execution_time": res.execution_time,
            "return_code": res.return_code,
            "stdout": res.stdout,
            "stderr": res.stderr,
        },
        "executor_pod_name": None,
        "files": {},
    }


def run_code_sync(request: dict, pool: SandboxPool) -> dict:
    """Blocking `run_code`."""
    return asyncio.run(run_code(request, pool))


def make_http_server(pool: SandboxPool, host: str = DEFAULT_HTTP_HOST, port: int = 8080):
    """A Sandbox-Fusion-compatible HTTP front: POST /run_code with the request JSON.

    Lets verl's SandboxFusionTool (sandbox_fusion_url=http://host:port/run_code) use our pool.
    Call `.serve_forever()` on the result (in a thread), `.shutdown()` to stop; `port=0` picks a
    free port (`server.server_address[1]`). It listens once made, and logs one line saying where.

    Args:
      pool: the SandboxPool that runs the code.
      host: address to bind; 127.0.0.1 by default, since the front has no authentication (any
        other address is logged as a warning).
      port: TCP port (0: any free one).
    """

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 -- http.server's naming
            if self.path.rstrip("/") != "/run_code":
                self.send_error(404, "only POST /run_code")
                return
            try:
                n = int(self.headers.get("Content-Length", "0"))
                req = json.loads(self.rfile.read(n) or b"{}")
                if not isinstance(req, dict):
                    raise ValueError("request body must be a JSON object")
            except ValueError as e:
                self.send_error(400, f"bad request: {e}")
                return
            body = json.dumps(run_code_sync(req, pool)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):
            logger.debug("run_code http: " + fmt, *args)

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    bound, bound_port = server.server_address[:2]
    loopback = ipaddress.ip_address(bound).is_loopback
    logger.log(
        logging.INFO if loopback else logging.WARNING,
        "sandbox /run_code front listening on http://%s:%d/run_code%s",
        bound,
        bound_port,
        "" if loopback else " (not loopback, and without authentication)",
    )
    return server
