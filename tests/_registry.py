"""Registering a toy record for the length of one test (the registry tests of scorers, detectors and
mask policies): `registered(register, registry, record, name)` calls the public `register` and removes
the record from `registry` afterwards, whatever the test did."""
from contextlib import contextmanager
from typing import Callable


@contextmanager
def registered(register: Callable, registry: dict, record, name: str):
    register(record)
    try:
        yield record
    finally:
        registry.pop(name, None)
