import json, time, httpx
from tests.e2e.conftest import read_metrics
from tests.e2e.test_server import ID_PROMPT

def test_dbg(server):
    http = httpx.Client(base_url=server.url, headers=server.headers, timeout=120)
    read_metrics(server.url)
    body = {"prompt": ID_PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        for i, line in enumerate(response.iter_lines()):
            print(time.monotonic(), i, repr(line[-80:]))
            if i > 6: break
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                m = read_metrics(server.url)
                print(time.monotonic(), {k: v for k, v in m.items() if 'creat' not in k and 'prefix' not in k and 'seconds' not in k})
