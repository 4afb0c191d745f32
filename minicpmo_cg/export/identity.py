"""Whether the identity the export commits with can be a person's: placeholder addresses.

Every exported commit is authored and signed off (``Signed-off-by``) by one identity, git's own or
``--author``'s (:func:`minicpmo_cg.export.cli.git_identity`). vllm-omni's DCO check only compares
the trailer with the commit's author, so a placeholder identity (a machine's default, a test
address) passes it, and a maintainer would then refuse the PR: the sign-off certifies nothing.

An address is a placeholder when it has no ``@`` or nothing after it, or when its domain is one no
mailbox can be under (the names are reserved for documentation and testing):

- the top-level domains ``.example``, ``.invalid``, ``.test`` and ``.localhost`` (RFC 2606 section 2,
  RFC 6761 sections 6.2 to 6.5), ``localhost`` itself included;
- ``example.com``, ``example.net`` and ``example.org`` and every name under them (RFC 2606 section 3).

The export warns (:func:`warn_if_placeholder`, through this module's logger), writes
:func:`stack_note` at the top of ``STACK.md``, and ``--verify`` reports the placeholder author of the
series as a problem (:mod:`.verify`).
"""

from __future__ import annotations

import logging

from minicpmo_cg.export.gitseries import Identity

__all__ = [
    "RESERVED_DOMAINS",
    "RESERVED_TLDS",
    "REEXPORT",
    "placeholder_problem",
    "placeholder_reason",
    "stack_note",
    "warn_if_placeholder",
]

logger = logging.getLogger(__name__)

#: Top-level domains reserved by RFC 2606 section 2 (and RFC 6761 sections 6.2 to 6.5).
RESERVED_TLDS = ("example", "invalid", "test", "localhost")
#: Second-level domains reserved by RFC 2606 section 3, with every name under them.
RESERVED_DOMAINS = ("example.com", "example.net", "example.org")
#: What to do about a placeholder identity, as every message about one says it.
REEXPORT = "before opening these PRs, re-export with --author 'Name <email>'"


def placeholder_reason(address: str) -> str | None:
    """Why the e-mail ``address`` cannot be a person's (a phrase: "has no @", "is under the reserved
    top-level domain .example (RFC 2606)"), or None when it can be one. Case-insensitive; a trailing
    dot of the domain is ignored."""
    local, at, domain = address.strip().rpartition("@")
    if not at:
        return "has no @"
    domain = domain.strip().rstrip(".").lower()
    if not local or not domain:
        return "has nothing before or after its @"
    tld = domain.rsplit(".", 1)[-1]
    if tld in RESERVED_TLDS:
        where = (
            f"is the reserved name {domain}"
            if domain == tld
            else f"is under the reserved top-level domain .{tld}"
        )
        return f"{where} (RFC 2606, RFC 6761)"
    for reserved in RESERVED_DOMAINS:
        if domain == reserved or domain.endswith("." + reserved):
            under = "is" if domain == reserved else "is under"
            return f"{under} the reserved domain {reserved} (RFC 2606)"
    return None


def placeholder_problem(identity: Identity | str) -> str | None:
    """The message about a placeholder ``identity`` (``Identity`` or ``"Name <email>"``), naming it,
    why its address is no person's and :data:`REEXPORT`; None when its address can be a person's."""
    text = str(identity)
    address = identity.email if isinstance(identity, Identity) else text.rpartition("<")[2].rstrip("> ")
    reason = placeholder_reason(address)
    if reason is None:
        return None
    return (
        f"every commit is authored and signed off by {text}, whose address {reason}: no person receives mail "
        "there, so vllm-omni's DCO check would accept the sign-off and a maintainer would not; "
        f"{REEXPORT}"
    )


def warn_if_placeholder(identity: Identity) -> str | None:
    """Log a WARNING (this module's logger) when ``identity`` is a placeholder; return the message
    (None when it is not one)."""
    problem = placeholder_problem(identity)
    if problem is not None:
        logger.warning("export: %s", problem)
    return problem


def stack_note(problem: str) -> str:
    """The paragraph ``STACK.md`` starts with when the export's identity is a placeholder."""
    return f"> **Placeholder identity.** {problem[0].upper()}{problem[1:]}.\n"
