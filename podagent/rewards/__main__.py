from podagent.rewards.cli import reward_server

reward_server(prog_name="python -m podagent.rewards")
