"""The loaders' grouped settings (loaders.options): one definition each, the same batches whichever way given."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import typing

import grain
import numpy as np
import pytest

import loaders
from loaders import grain as grain_loader, graph as lg, options
from tests.loaders import make_outputs

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The public loader functions: every one of them takes the grouped settings.
LOADERS = {"grain.py": ("dataset", "map_dataset", "records"), "xla.py": ("device_loader",),
           "jax.py": ("dataset", "graph_dataset"), "tfdata.py": ("dataset",),
           "graph.py": ("grain_dataset", "xla_loader")}
FIELDS = {f.name for g in (options.Ordering, options.Sharding, options.Fetching, options.ExampleOptions,
                           options.Reading) for f in dataclasses.fields(g)}


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
  features, payloads = make_outputs.raw_images(np.random.default_rng(0), 40, size=(8, 8))
  return make_outputs.write(str(tmp_path_factory.mktemp("raw") / "out"), features, {"train": payloads}, kind="image",
                            num_shards=4)


def _batches(ds) -> list[dict]:
  out = list(ds)
  ds.close()
  return out


def _equal(a: list[dict], b: list[dict]) -> None:
  assert len(a) == len(b) > 0
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_groups_and_fields_by_name_give_the_same_batches(raw):
  flat = _batches(grain_loader.dataset(raw, batch_size=4, seed=3, num_epochs=2, shard_index=1, shard_count=2,
                                       verify="size", num_threads=2))
  grouped = _batches(grain_loader.dataset(raw, batch_size=4, ordering=loaders.Ordering(seed=3, num_epochs=2),
                                          sharding=loaders.Sharding(1, 2), fetching=loaders.Fetching(verify="size"),
                                          reading=loaders.Reading(num_threads=2)))
  _equal(flat, grouped)


def test_grains_own_shard_and_read_options_are_accepted(raw):
  ours = _batches(grain_loader.dataset(raw, batch_size=4, sharding=loaders.Sharding(1, 2), num_threads=2))
  theirs = _batches(grain_loader.dataset(raw, batch_size=4, sharding=grain.sharding.ShardOptions(1, 2),
                                         reading=grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)))
  _equal(ours, theirs)
  other = _batches(grain_loader.dataset(raw, batch_size=4, sharding=grain.sharding.ShardOptions(0, 2),
                                        num_threads=2))
  assert not np.array_equal(other[0]["record_index"], ours[0]["record_index"])


def test_a_setting_given_twice_or_unknown_is_a_type_error(raw):
  with pytest.raises(TypeError, match="seed is given both by name and in ordering="):
    grain_loader.dataset(raw, batch_size=4, ordering=loaders.Ordering(), seed=1)
  with pytest.raises(TypeError, match="unexpected keyword argument 'sead'"):
    grain_loader.dataset(raw, batch_size=4, sead=1)
  with pytest.raises(TypeError, match="ordering must be a loaders.Ordering"):
    grain_loader.dataset(raw, batch_size=4, ordering=loaders.Fetching())
  with pytest.raises(TypeError, match="sharding must be a loaders.Sharding or a grain ShardOptions"):
    grain_loader.dataset(raw, batch_size=4, sharding=(0, 2))


def test_what_a_call_leaves_unset_is_the_loaders_default_however_the_settings_are_given():
  for given in ({"num_threads": 2}, {"reading": loaders.Reading(num_threads=2)}):
    assert options.settings("t", **given).reading == loaders.Reading(2, 64)
    assert options.settings("t", defaults=options.GRAPH_DEFAULTS, **given).reading == loaders.Reading(2, 8)
  for given in ({"seed": 3}, {"ordering": loaders.Ordering(seed=3)}):
    assert options.settings("t", **given).ordering.order == "global"
    assert options.settings("t", defaults=options.TFDATA_DEFAULTS, **given).ordering.order == "host"
    assert options.settings("t", **given).ordering.drop_remainder is True


def test_a_setting_a_loader_does_not_read_is_refused_not_ignored(raw):
  with pytest.raises(ValueError, match=r"loaders.grain.records does not read num_epochs \(set to 3\)"):
    grain_loader.records(raw, num_epochs=3)
  with pytest.raises(ValueError, match="does not read num_threads"):
    grain_loader.map_dataset(raw, batch_size=4, num_threads=2)
  with pytest.raises(ValueError, match="does not read seed"):
    lg.grain_dataset(None, seed=4)  # the sampler holds its seed; refused before the sampler is touched
  with pytest.raises(ValueError, match="fetch='records' chooses how windows are streamed: it needs window_shards"):
    grain_loader.dataset(raw, batch_size=4, fetch="records")


def test_records_takes_drop_remainder_once(raw):
  """grain's ShardOptions carries its own drop_remainder: records reads it, and refuses another one."""
  def count(**kw):
    ds = grain_loader.records(raw, shuffle=False, **kw)
    n = len(ds)
    ds.close()
    return n
  assert count(sharding=grain.sharding.ShardOptions(0, 3, drop_remainder=False)) == 14
  assert count(sharding=grain.sharding.ShardOptions(0, 3, drop_remainder=True)) == 13
  assert count(shard_index=0, shard_count=3, drop_remainder=False) == 14
  with pytest.raises(TypeError, match="drop_remainder=True disagrees with the ShardOptions' drop_remainder=False"):
    grain_loader.records(raw, sharding=grain.sharding.ShardOptions(0, 3, drop_remainder=False), drop_remainder=True)
  with pytest.raises(TypeError, match="drop_remainder=False disagrees"):
    grain_loader.records(raw, sharding=grain.sharding.ShardOptions(0, 3, drop_remainder=True),
                         ordering=loaders.Ordering(drop_remainder=False))


def test_a_state_names_the_batch_and_the_remainder_rule(raw):
  """A position names other records under another batch size or remainder rule: refused on restore."""
  it = iter(grain_loader.dataset(raw, batch_size=4, seed=1, num_threads=1))
  next(it)
  state = it.get_state()
  for other in ({"batch_size": 8}, {"batch_size": 4, "drop_remainder": False}):
    with pytest.raises(loaders.StateMismatchError, match="other order settings"):
      iter(grain_loader.dataset(raw, seed=1, num_threads=1, **other)).set_state(state)
  old = dict(state, order={k: v for k, v in state["order"].items() if k != "batch"})  # saved before it was stamped
  resumed = iter(grain_loader.dataset(raw, batch_size=4, seed=1, num_threads=1))
  resumed.set_state(old)
  np.testing.assert_array_equal(next(resumed)["record_index"], next(it)["record_index"])


@pytest.mark.parametrize("make, message", [
    (lambda: loaders.Ordering(order="random"), "order must be one of"),
    (lambda: loaders.Ordering(num_epochs=0), "num_epochs must be >= 1"),
    (lambda: loaders.Ordering(window_shards=True), "window_shards must be >= 1"),
    (lambda: loaders.Ordering(on_new_data="ignore"), "on_new_data must be one of"),
    (lambda: loaders.Sharding(2, 2), r"shard_index 2 is outside \[0, 2\)"),
    (lambda: loaders.Sharding(-1), "shard_index must be an integer >= 0"),
    (lambda: loaders.Ordering(run_records=4), "run_records=4 shapes windows: it needs window_shards"),
    (lambda: loaders.Ordering(seed=None), "seed must be an integer"),
    (lambda: loaders.Ordering(shuffle="no"), "shuffle must be True or False"),
    (lambda: loaders.Fetching(fetch="all"), "fetch must be one of"),
    (lambda: loaders.Fetching(verify="md5"), "verify must be one of"),
    (lambda: loaders.Fetching(cache_limit_bytes=0), "cache_limit_bytes must be >= 1"),
    (lambda: loaders.Reading(num_threads=0), "num_threads must be >= 1"),
    (lambda: loaders.ExampleOptions(patch="edge"), "patch must be random or center"),
])
def test_each_group_refuses_a_bad_value_on_construction(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_numpy_integers_shard_as_ints():
  sharding = loaders.Sharding(np.int64(1), np.int32(2))
  assert (sharding.shard_index, sharding.shard_count) == (1, 2) and type(sharding.shard_index) is int


def test_the_choices_are_typed_as_literals():
  hints = {**typing.get_type_hints(options.Ordering), **typing.get_type_hints(options.Fetching),
           **typing.get_type_hints(options.ExampleOptions)}
  assert typing.get_args(hints["order"]) == (options.Order, type(None))
  assert typing.get_args(options.Order) == ("global", "host")
  assert typing.get_args(hints["on_new_data"]) == ("error", "restart_epoch")
  assert typing.get_args(hints["fetch"]) == ("auto", "shards", "records")
  assert typing.get_args(hints["patch"]) == ("random", "center")


def test_each_setting_is_defined_in_one_place():
  """No public loader function declares a setting's parameter (and so its default) itself."""
  for module, names in LOADERS.items():
    tree = ast.parse((ROOT / "loaders" / module).read_text())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in names:
      args = functions[name].args
      declared = {a.arg for a in args.args + args.kwonlyargs}
      assert not declared & FIELDS, f"loaders/{module} {name} declares {sorted(declared & FIELDS)}"
      assert args.kwarg is not None, f"loaders/{module} {name} takes no settings by name"
      assert "ordering" in declared, f"loaders/{module} {name} does not take the groups"
