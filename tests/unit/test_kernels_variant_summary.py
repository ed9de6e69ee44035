"""The test suite's kernel-variant selection (``tests/kernel_variants.py``): cases of variants
the CPU cannot run are deselected and named as untested, a failed build keeps every case."""

from __future__ import annotations

import types

import pytest

from tests import kernel_variants


class _Item:
    def __init__(self, *args):
        self.marker = None if not args else types.SimpleNamespace(args=args)
        self.nodeid = f"case{id(self)}"

    def get_closest_marker(self, name):
        assert name == kernel_variants.MARKER
        return self.marker


class _Config:
    def __init__(self):
        self.deselected = []
        self.hook = types.SimpleNamespace(pytest_deselected=self._deselect)

    def _deselect(self, items):
        self.deselected += items


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(kernel_variants, "_tested", {})
    monkeypatch.setattr(kernel_variants, "_untested", {})
    monkeypatch.setattr(kernel_variants, "_variants_of", {})


def _ran(item, outcome="passed", when="call"):
    report = types.SimpleNamespace(
        nodeid=item.nodeid, when=when, outcome=outcome, skipped=outcome == "skipped"
    )
    kernel_variants.record(report)


def test_unrunnable_variants_are_deselected_and_named(fresh, monkeypatch):
    table = {"prefill": (("avx512_bf16", "avx2"), {"avx512_amx": "no AMX"}, False)}
    monkeypatch.setattr(kernel_variants, "status", lambda family: table[family])
    plain, bf16, amx, every = (
        _Item(),
        _Item("prefill", "avx512_bf16"),
        _Item("prefill", "avx512_amx"),
        _Item("prefill"),
    )
    items, config = [plain, bf16, amx, every], _Config()
    kernel_variants.select(config, items)
    assert items == [plain, bf16, every] and config.deselected == [amx]
    for item in items:
        _ran(item, when="setup")
        _ran(item)
        _ran(item, when="teardown")
    assert kernel_variants.summary() == (
        "kernel variants tested (cases run): prefill/avx512_bf16 (2), prefill/avx2 (1); "
        "untested, this CPU cannot run them: prefill/avx512_amx (no AMX)"
    )


def test_only_cases_that_ran_are_counted(fresh, monkeypatch):
    table = {"decode": (("avx512", "avx2"), {}, False)}
    monkeypatch.setattr(kernel_variants, "status", lambda family: table[family])
    passed, failed, skipped, never = (_Item("decode", "avx512") for _ in range(4))
    items = [passed, failed, skipped, never, _Item("decode", "avx2")]
    kernel_variants.select(_Config(), items)
    _ran(passed)
    _ran(failed, "failed")
    _ran(skipped, "skipped")
    assert kernel_variants.summary() == (
        "kernel variants tested (cases run): decode/avx512 (2); "
        "untested, this CPU cannot run them: none"
    )


def test_a_failed_build_keeps_every_case(fresh, monkeypatch):
    monkeypatch.setattr(kernel_variants, "status", lambda family: ((), {"avx2": "x"}, True))
    items, config = [_Item("prefill", "avx2"), _Item("decode")], _Config()
    kept = list(items)
    kernel_variants.select(config, items)
    assert items == kept and config.deselected == []


def test_no_marked_case_no_summary(fresh):
    items = [_Item()]
    kernel_variants.select(_Config(), items)
    assert kernel_variants.summary() is None
