"""Text from outside dstrain, printed through rich exactly as written.

rich reads `[...]` in a printed string as markup and `:name:` as an emoji: a lock note quoting
`--set data.paths=[/data/chat.jsonl]` raised MarkupError (issue 54), and `[bold]` in a path would restyle
the line. Every string that comes from a user, a file, a command line, the environment or another
library's exception goes through `outside()` before it meets dstrain's own markup (`[yellow]note:[/]`).
A rich Text object is never parsed, so text put into a Text needs nothing.
"""

from __future__ import annotations

import re

# An empty span: ends the run of text before it, so what follows cannot join that text into an emoji
# code, and the backslashes before it are read as escaped backslashes (rich halves them before a tag).
_BREAK = "[none][/none]"
# What rich would read as markup: a run of backslashes before '[' or at the end (what follows the text
# is not known here), an opening bracket, and a colon that may open an emoji code (":fire:").
_SPECIAL = re.compile(r"\\+(?=\[|\Z)|\[|:(?=\S*:)")


def _escaped(match: re.Match) -> str:
    found = match.group(0)
    if found == "[":
        # '\[' is read as a literal '[' both where it would open a tag and where it would not.
        return "\\["
    if found == ":":
        return ":" + _BREAK
    return found * 2 + _BREAK


def outside(value: object) -> str:
    """`str(value)` as rich markup that prints exactly that text.

    rich.markup.escape is not enough: it leaves a backslash before a '[' that opens no tag (rich then
    drops the backslash), emoji codes, and a trailing backslash that escapes dstrain's closing tag.
    """
    return _SPECIAL.sub(_escaped, str(value))
