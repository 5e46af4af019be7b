"""Creation of ProcessGroupResident from torch.distributed's extended backend API."""

from datetime import timedelta

from resident_pg import _C, handoff, options

# Keys passed on to the core; the removed ones too, whose error there says why they are refused.
_OPTION_KEYS = options.PG_KEYS
_REMOVED_KEYS = tuple(o["key"] for o in options.REMOVED)


def normalize_options(backend_options):
    """pg_options for the resident backend: None or a dict of RESIDENT_* settings.

    Keys are the variable names without the RESIDENT_ prefix, in lower case, e.g.
    ``{"path": "proxy", "slot_bytes": 65536}``; they override the environment for that group.
    """
    if backend_options is None:
        return {}
    if not isinstance(backend_options, dict):
        raise TypeError(
            "resident: pg_options must be a dict of RESIDENT_* settings, e.g. "
            f"{{'path': 'proxy'}}; got {type(backend_options).__name__}"
        )
    out = {}
    for key, value in backend_options.items():
        k = str(key).lower().removeprefix("resident_")
        if k not in _OPTION_KEYS and k not in _REMOVED_KEYS:
            near = options.closest(k, pg_only=True)
            hint = f"did you mean {near.removeprefix('RESIDENT_').lower()!r}? " if near else ""
            raise ValueError(f"resident: unknown option {key!r} "
                             f"({hint}known: {', '.join(_OPTION_KEYS)})")
        out[k] = str(value)
    return out


def create_backend(dist_backend_opts, backend_options):
    timeout = dist_backend_opts.timeout
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    global_ranks = [int(r) for r in (getattr(dist_backend_opts, "global_ranks_in_group", None) or [])]
    pg = _C.ProcessGroupResident(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        timeout,
        normalize_options(backend_options),
        # errors name ranks as the user knows them (a subgroup's rank r is another global rank)
        global_ranks,
    )
    handoff.set_up(pg, dist_backend_opts, timeout, global_ranks)
    return pg
