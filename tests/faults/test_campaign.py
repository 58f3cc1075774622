"""The fault campaign's sample: every fault of the catalogue and every state of the lifecycle at
least once (tests/harness/campaign.py says what each is and what is checked). Each cell is a
real head and worker taken to its state, the fault, the run let go to its end, and the
invariants (a)-(e) checked on the outcome. `python bench/faults.py --cells all` runs the whole
matrix; a failing cell here runs again, exactly, with the line its failure prints."""

from __future__ import annotations

import pytest

from tests.harness import campaign

SEED = 2126  # bench/faults.py's default: the CI sample and the table in docs/faults.md agree


@pytest.mark.parametrize("name", campaign.SAMPLE)
def test_the_cell_holds_every_invariant(name: str, campaign_host: None, tmp_path) -> None:
    cell = campaign.parse(name, SEED)
    result = campaign.run_cell(cell, tmp_path / "cell")
    again = f"again: python bench/faults.py --cells {name} --seed {SEED}"
    timeline = "\n".join(f"  {t:7.2f} s  {what}" for t, what in result.timeline)
    assert not result.error, f"the cell could not run: {result.error} ({again})\n{timeline}"
    assert result.held, (f"{cell.name} (the fault came in state {result.state_seen}): "
                         + "; ".join(result.violations) + f" ({again})\n{timeline}")
