"""`inferd serve --ray`'s flags: the replica count they ask for, and refusals before anything
loads (no Ray cluster is started by these)."""

from __future__ import annotations

import pytest

from inferd.cli import main
from inferd.ray.args import Scale


def test_replicas_and_autoscale_become_serve_options() -> None:
    assert Scale.parse(None, None).options() == {"num_replicas": 2}
    assert Scale.parse(3, None).options() == {"num_replicas": 3}
    auto = Scale.parse(None, "1:4").options()["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["initial_replicas"]) == (1, 4, 1)
    assert Scale.parse(None, "0:2").options()["autoscaling_config"]["initial_replicas"] == 1
    assert Scale.parse(None, "1:4").describe() == "autoscaling 1..4 replicas"


@pytest.mark.parametrize(
    ("replicas", "autoscale", "message"),
    [
        (2, "1:2", "not both"),
        (0, None, "at least 1"),
        (None, "3:1", "MIN <= MAX"),
        (None, "two", "MIN:MAX"),
    ],
)
def test_bad_scale_flags_are_refused(
    replicas: int | None, autoscale: str | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Scale.parse(replicas, autoscale)


def test_serve_ray_refuses_bad_flags_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--ray", "--autoscale", "4:1"]) == 2
    assert "--autoscale" in capsys.readouterr().err
    assert main(["serve", "--ray", "--config", "models.json"]) == 2
    assert "--ray serves one -m model" in capsys.readouterr().err


def test_a_serve_config_builds_the_application() -> None:
    from ray.serve import Application

    from inferd.ray.deployment import from_config

    app = from_config({"model": "smollm2", "replicas": 3, "num_cpus": 2, "kv_cache_tokens": 4096})
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="unknown inferd args"):
        from_config({"modle": "smollm2"})
    with pytest.raises(ValueError, match="replicas must be int"):
        from_config({"replicas": "2"})
