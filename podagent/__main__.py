from podagent.cli import main

main(prog_name="podagent")
