"""Re-labelling the resource of providers in place (the SDK's ``Resource`` is immutable by API):
used by :func:`llm_otel.process.identity.relabel` in a serving process and by the exporter process
(:mod:`llm_otel.export.offload`) when the serving process's resource changes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def resource_of(provider):
    """The resource a tracer or meter provider currently reads (None when it has none)."""
    sdk_config = getattr(provider, "_sdk_config", None)  # MeterProvider
    return getattr(sdk_config, "resource", None) if sdk_config is not None else getattr(provider, "resource", None)


def set_attributes(resource, attrs: Mapping[str, Any]) -> None:
    """Replace every attribute of ``resource`` by ``attrs`` (see below why this is safe)."""
    # The SDK's Resource is immutable by API; its attributes live in one BoundedAttributes that
    # every tracer, span and metric reader reads through the same Resource object, so replacing it
    # re-labels them all (opentelemetry-sdk 1.42: Resource.__init__ / .attributes). Only this
    # process's copy changes (after fork) or nothing has used it yet (a spawned child's bootstrap).
    from opentelemetry.attributes import BoundedAttributes

    resource._attributes = BoundedAttributes(attributes=dict(attrs), immutable=True)
