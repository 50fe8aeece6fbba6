"""Shared by the tests of bad scenarios: `simtrain validate` of a scenario written from a dict, which must exit 2
with one line."""
import pytest
import yaml

from simtrain.cli import main


def refusal(tmp_path, capsys, raw: dict) -> str:
    """The one line `simtrain validate` prints for scenario `raw` (written to tmp_path), after checking it exits 2."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err
