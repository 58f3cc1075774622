"""The built-in reward server: math answers checked against gold answers, over HTTP.

OpenRLHF's remote reward protocol (`POST /get_reward`, `GET /health`), by one of three scoring
profiles (`--scoring`): `openrlhf-m`, the default, is OpenRLHF-M's own reward server item for
item (`openrlhf_m`, `openrlhf_m_verify`); `boxed` checks the last \\boxed{} answer (`verify`);
`openrlhf-boxed` is upstream OpenRLHF's math reward function (`openrlhf_boxed`). Or a user's
`reward_func` file (`--func`, `func`). How a batch is scored cheaply is in `scorer`, small
requests batched in `batching`, the pool in `pool`, several server processes in `listeners`,
the dataset audit in `audit`, what differs between the math-verify releases in `mvcompat`;
verl's client is `client`.

As a process (what podagent's head starts; flags or PODAGENT_REWARD_* variables):

    python -m podagent.rewards --host 10.0.0.2 --port 5000 [--workers N] [--dataset FILE]
        [--scoring openrlhf-m|boxed|openrlhf-boxed] [--func FILE] [--listeners N] ...
    podagent reward-server ...                  # the same command

Ready when `GET /health` (or a `POST /get_reward`) answers 200; SIGTERM stops it with exit 0.

In a program (multiprocessing rules apply: guard the entry point with __name__ == "__main__"):

    from podagent.rewards import server, settings
    s = settings.build({"host": "10.0.0.2"})    # flags > environment > defaults; ConfigError
    server.serve(s, server.load_golds(s))       # blocks until SIGTERM/SIGINT, returns 0
    async with server.running(s) as r: ...      # inside your own event loop; r.url, r.scorer

Scoring one item without a server: `openrlhf_m.response_of(query, "chatml")`,
`openrlhf_m.well_formed(response)` and `openrlhf_m_verify.Checker().check(response,
openrlhf_m.gold_form(gold))`; boxed: `verify.score(response, gold, verify.Verifier())`.
"""
