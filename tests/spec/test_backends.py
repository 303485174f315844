"""The table of rendezvous backends (``spec/backends.py``) is the one home of what the package
decides by a backend's name: every user of a backend reads its row."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

import elastic_harness
from elastic_harness import deps
from elastic_harness.errors import SpecError
from elastic_harness.launch.config import endpoints_with_ports
from elastic_harness.rendezvous import handler
from elastic_harness.spec import backends, parse_job
from elastic_harness.spec.schema import RendezvousSpec

PACKAGE = Path(elastic_harness.__file__).parent
# A backend's name compared with a word: what the table answers instead.
COMPARED = re.compile(r"""(backend|rdzv_backend)\s*(==|!=|\bin\b|\bnot in\b)\s*["'(\[]""")
# What may still name backends: the table, and the rendezvous code that implements each
# (the table's rows name its state backends in ``handler.creators``; each names itself).
# The benches compare backends side by side on purpose.
IMPLEMENTS = {"spec/backends.py", "rendezvous/handler.py", "rendezvous/sealed.py", "rendezvous/etcd_v3.py"}


def test_the_spec_offers_exactly_the_tables_backends():
    assert typing.get_args(typing.get_type_hints(RendezvousSpec)["backend"]) == backends.NAMES
    with pytest.raises(SpecError) as err:
        parse_job("rendezvous: {backend: zookeeper}")
    assert all(name in str(err.value) for name in backends.NAMES), str(err.value)


def test_every_backend_has_its_state_backend_and_its_name_in_torchs_registry():
    assert set(handler.creators()) == {b.torch_name for b in backends.BACKENDS}
    assert {b.torch_name: b.registered for b in backends.BACKENDS} == handler.REGISTERED
    assert len({b.registered for b in backends.BACKENDS}) == len(backends.BACKENDS)


@pytest.mark.parametrize("row", backends.BACKENDS, ids=lambda b: b.name)
def test_a_row_gives_the_port_the_extra_and_the_fix(row):
    assert endpoints_with_ports("h", row.torch_name, "rendezvous.endpoint") == f"h:{row.port}"
    spec = parse_job(f"task: {{target: 'a.b:C'}}\nrendezvous: {{backend: {row.name}, endpoint: 'h:1'}}")
    assert deps.extras_for(spec) == ([row.extra] if row.extra else [])
    assert not row.extra or row.extra in deps.EXTRAS
    assert row.unreachable_fix, "the agent's line when it cannot reach the backend says what to do"


def test_no_module_decides_by_a_backends_name_outside_the_table():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in IMPLEMENTS or rel.startswith("bench/"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if COMPARED.search(line):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "read the backend's row in spec/backends.py instead:\n" + "\n".join(found)
