"""Driving one actor in a test without its loop: its peers are plain mailboxes the test reads."""

from __future__ import annotations

from typing import TypeVar

from runtime.actor import Actor, Mailbox

M = TypeVar("M")


async def handle_queued(actor: Actor) -> None:
    """Handle every message in the actor's mailbox, in order, as its loop would (messages it
    sends itself meanwhile included)."""
    while not actor.mailbox.empty():
        await actor.handle(actor.mailbox.get_nowait())


def taken(box: Mailbox[M]) -> list[M]:
    """Every message in `box`, in order, leaving it empty."""
    out = []
    while not box.empty():
        out.append(box.get_nowait())
    return out
