"""The built-in reward server: math answers checked against gold answers, over HTTP.

OpenRLHF's remote reward protocol (`POST /get_reward`, `GET /health`); what a reward is, is
documented in `verify`, how a batch is scored cheaply in `scorer`, the pool in `pool`.

As a process (what podagent's head starts; flags or PODAGENT_REWARD_* variables):

    python -m podagent.rewards --host 10.0.0.2 --port 5000 [--workers N] [--dataset FILE]
    podagent reward-server ...                  # the same command

Ready when `GET /health` (or a `POST /get_reward`) answers 200; SIGTERM stops it with exit 0.

In a program (multiprocessing rules apply: guard the entry point with __name__ == "__main__"):

    from podagent.rewards import server, settings
    s = settings.build({"host": "10.0.0.2"})    # flags > environment > defaults; ConfigError
    server.serve(s, server.load_golds(s))       # blocks until SIGTERM/SIGINT, returns 0
    async with server.running(s) as r: ...      # inside your own event loop; r.url, r.scorer

Scoring one response without a server: `verify.score(response, gold, verify.Verifier())`.
"""
