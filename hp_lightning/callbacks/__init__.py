"""Per-step policy callbacks for HSDPStrategy (gradient sync, scaling, resharding, reports)."""

__all__: list[str] = []
