"""Whether the Hugging Face Hub answers, known in seconds. Without network huggingface_hub retries
every request with backoff (five tries, for each weight file timm asks for), so a download that
cannot happen takes minutes to fail; one short request first tells at once."""

from __future__ import annotations

import os
import threading

# Long enough for a slow but working connection to answer a HEAD request; short enough that a
# machine without network learns it at once.
PROBE_SECONDS = 4.0

_answers: dict[str, str | None] = {}  # endpoint -> why it did not answer (None: it did), once per process


def unreachable() -> str | None:
    """Why the Hub cannot be reached (None: it answers, or offline mode already keeps every request
    off it). When it cannot, this process asks only the local cache from then on, as
    `HF_HUB_OFFLINE=1` would: weights downloaded before still load, missing ones fail at once."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    endpoint = constants.ENDPOINT
    if endpoint not in _answers:
        _answers[endpoint] = _probe(endpoint)
    why = _answers[endpoint]
    if why is not None:
        # huggingface_hub reads HF_HUB_OFFLINE once, at import; every request checks the constant it
        # read (constants.is_offline_mode), so setting that switches this process to the cache. The
        # environment variable is for the processes it starts.
        constants.HF_HUB_OFFLINE = True
        os.environ["HF_HUB_OFFLINE"] = "1"
    return why


def _probe(endpoint: str) -> str | None:
    """One HEAD request through huggingface_hub's own client (its proxies and certificates), in a
    thread joined with a deadline: a name lookup that hangs is not bounded by the request's timeout."""
    from huggingface_hub.utils import get_session

    outcome: list[BaseException | None] = []

    def head() -> None:
        try:
            get_session().head(endpoint, timeout=PROBE_SECONDS)
            outcome.append(None)
        except Exception as e:  # noqa: BLE001 - any failure to get an answer means "unreachable"
            outcome.append(e)

    thread = threading.Thread(target=head, name="vramfit-hub-probe", daemon=True)
    thread.start()
    thread.join(PROBE_SECONDS + 1)
    if outcome and outcome[0] is None:
        return None
    detail = (f"{type(outcome[0]).__name__}: {(str(outcome[0]).splitlines() or [''])[0][:160]}" if outcome
              else f"no answer within {PROBE_SECONDS:g} s")
    return f"the Hugging Face Hub ({endpoint}) does not answer ({detail})"
