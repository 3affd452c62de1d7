"""The models file: prices, declared provider limits, bad files, and its TTL cache."""

from pathlib import Path

import pytest

from moorline.errors import ConfigError
from moorline.llm.models import ModelEntry, ModelsProvider, load_models_file, unpriced
from moorline.settings import Settings
from tests.helpers import FakeClock

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "models.yaml"

MODELS = """
models:
  gpt-4o-mini:
    input_per_million: 0.15
    output_per_million: 0.60
    cached_input_per_million: 0.075
    rpm: 500
    tpm: 200000
  local:
    input_per_million: 0
    output_per_million: 0
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_entries_and_limits(tmp_path: Path) -> None:
    models = load_models_file(write(tmp_path, MODELS))
    mini = models["gpt-4o-mini"]
    assert (mini.rpm, mini.tpm) == (500, 200000)
    assert (models["local"].rpm, models["local"].tpm) == (None, None)


def test_cost_charges_cached_tokens_at_their_price() -> None:
    entry = ModelEntry(
        name="m", input_per_million=1.0, output_per_million=4.0, cached_input_per_million=0.5
    )
    # 1000 prompt tokens of which 400 cached, 100 completion tokens.
    assert entry.cost(1000, 100, 400) == pytest.approx((600 * 1.0 + 400 * 0.5 + 100 * 4.0) / 1e6)
    no_cached_price = ModelEntry(name="m", input_per_million=1.0, output_per_million=4.0)
    assert no_cached_price.cost(1000, 0, 400) == pytest.approx(1000 / 1e6)
    assert unpriced("x").cost(10**6, 10**6, 0) == 0


def test_example_file_is_valid() -> None:
    models = load_models_file(EXAMPLE)
    assert "gpt-4o-mini" in models and models["gpt-4o-mini"].rpm is not None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("models: {m: {input_per_million: 1}}\n", r"models\.m\.output_per_million"),
        (
            "models: {m: {input_per_million: -1, output_per_million: 1}}\n",
            r"models\.m\.input_per_million",
        ),
        (
            "models: {m: {input_per_million: 1, output_per_million: 1, rpm: 0}}\n",
            r"models\.m\.rpm",
        ),
        (
            "models: {m: {input_per_million: 1, output_per_million: 1, price: 2}}\n",
            r"unknown key 'models\.m\.price'",
        ),
        ("model: {}\n", r"unknown key 'model'"),
        ("models: {m: [\n", "not valid YAML at line"),
    ],
)
def test_bad_file_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_models_file(path)
    assert str(path) in str(caught.value)
    with pytest.raises(ConfigError):
        ModelsProvider(Settings(models_file=path))


def test_missing_file_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="MOORLINE_MODELS_FILE: cannot read"):
        ModelsProvider(Settings(models_file=tmp_path / "nope.yaml"))


async def test_no_file_every_model_is_free() -> None:
    entry = await ModelsProvider(Settings()).get("gpt-4o")
    assert entry == unpriced("gpt-4o")


async def test_provider_rereads_after_ttl_and_keeps_last_good(tmp_path: Path) -> None:
    path = write(tmp_path, MODELS)
    clock = FakeClock()
    provider = ModelsProvider(Settings(models_file=path), ttl_s=5.0, clock=clock)
    assert (await provider.get("gpt-4o-mini")).rpm == 500
    path.write_text(MODELS.replace("rpm: 500", "rpm: 600"), encoding="utf-8")
    clock.now += 4.9
    assert (await provider.get("gpt-4o-mini")).rpm == 500
    clock.now += 0.2
    assert (await provider.get("gpt-4o-mini")).rpm == 600
    path.write_text("models: {m: {bogus: 1}}\n", encoding="utf-8")
    clock.now += 6
    assert (await provider.get("gpt-4o-mini")).rpm == 600
