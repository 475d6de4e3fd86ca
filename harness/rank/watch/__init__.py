"""A loop followed as it is: ``loop`` (``Watch``, what ``ctx.watch`` makes: the oracle and the checks run from
the calls the loop makes anyway), and what it shares with a script's watch (harness/rank/script/): the
prepared dataloaders it follows (``loaders``), which drawn batch each forward was given (``forwards``),
what the loop asks of its syncs and optimizers (``asked``), and the attributes set for as long as a watch
lasts (``patching``). It imports nothing when imported; it holds the one error of the room, whose name a
cell's summary shows (``harness.rank.watch.LoopRefused``)."""


class LoopRefused(ValueError):
    """What the watch cannot infer from the loop's calls: one line, with what to give instead."""
