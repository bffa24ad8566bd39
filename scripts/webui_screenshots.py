"""The screenshots in docs/images/: the playground and the dashboard on the default model.

    .venv/bin/python scripts/webui_screenshots.py [OUT_DIR]   # default docs/images

Starts `inferlab serve`'s app on 127.0.0.1 (a free port) and Debian's chromium (Playwright),
asks one question, opens its tokens, runs a short bounded load and draws one request's trace.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_harness import ServerThread  # noqa: E402
from webui_support import bench_doc  # noqa: E402

from inferlab.engine.engine_args import EngineArgs  # noqa: E402
from inferlab.engine.llm_engine import LLMEngine  # noqa: E402
from inferlab.server.app import ServerSettings, build_app  # noqa: E402

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def main() -> None:
    from playwright.sync_api import sync_playwright

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images")
    out.mkdir(parents=True, exist_ok=True)
    config = EngineArgs(max_model_len=2048).create_engine_config()
    app = build_app(lambda: LLMEngine(config), ServerSettings())
    with ServerThread(app) as srv, sync_playwright() as p:
        srv.wait_ready(600)
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        page.set_default_timeout(120_000)
        page.goto(srv.url("/"))
        page.wait_for_selector("#model option", state="attached")
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "48")
        page.fill("#prompt", "What is the capital of France? Answer in one sentence.")
        page.press("#prompt", "Enter")
        page.locator(".msg.assistant .status", has_text="finished").wait_for()
        page.locator("button.show-tokens").click()
        page.locator(".answer-tokens .tok").first.wait_for()
        page.screenshot(path=str(out / "playground.png"), full_page=True)

        page.goto(srv.url("/dashboard"))
        body = {"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 64}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: httpx.post(srv.url("/v1/chat/completions"), json=body, timeout=300), range(12)))
        page.wait_for_timeout(3000)
        bench = out / "bench-example.json"
        bench.write_text(json.dumps(bench_doc()))
        page.set_input_files("#bench-file", str(bench))
        bench.unlink()
        page.locator("#recent li").first.click()
        page.wait_for_selector("#trace-svg[data-request]")
        page.screenshot(path=str(out / "dashboard.png"), full_page=True)
        browser.close()
    print(f"wrote {out / 'playground.png'} and {out / 'dashboard.png'}")


if __name__ == "__main__":
    main()
