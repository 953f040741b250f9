"""Grouped ``--help`` for ``dtrain run``, ``ps`` and ``sweep`` (the edge).

click lists a command's options as one flat list, and ``dtrain run`` has more
than sixty.  ``GroupedCommand`` writes them under named headings instead (one
section per group of ``OPTION_GROUPS``, the groups and their options in the
order given there), all sections aligned alike, and ends with the line naming
the full manual.  Hidden options (other launchers' spellings, cli/dialects.py)
stay hidden.  tests/test_help.py checks that every option shown has a group.
"""

from __future__ import annotations

import click

from launcher.core.options import SECTIONS

# Heading -> the options under it (parameter names), in the order shown: the table's sections
# (a name is in one group whatever command has it; a command shows the groups it has).
OPTION_GROUPS: tuple[tuple[str, str], ...] = (
    *(
        (heading, " ".join(dict.fromkeys(row.field for row in rows)))
        for heading, rows in SECTIONS.items()
    ),
    ("Other", "help"),
)
GROUP_OF = {name: heading for heading, names in OPTION_GROUPS for name in names.split()}
ORDER = {name: place for place, name in enumerate(" ".join(n for _, n in OPTION_GROUPS).split())}
UNGROUPED = "Other"  # an option missing from the table still shows (the test catches it)
TERM_MAX = 30  # the widest option column; a longer option has its text on the next line
COLUMN_GAP = 2
GLUE = "\xa0"  # a space textwrap does not break at


class GroupedCommand(click.Command):
    """A click command whose ``--help`` shows its options in groups, then its manual."""

    def __init__(self, *args: object, manual: str = "docs/running.md", **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.manual = manual

    def option_groups(self, ctx: click.Context) -> list[tuple[str, list[tuple[str, str]]]]:
        """Each group with the help records (option, text) of this command's options in it."""
        found: dict[str, list[tuple[int, tuple[str, str]]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None or isinstance(param, click.Argument):
                continue  # hidden, or COMMAND
            name = grouped_name(param, ctx)
            heading = GROUP_OF.get(name, UNGROUPED)
            found.setdefault(heading, []).append((ORDER.get(name, len(ORDER)), record))
        return [
            (heading, [record for _, record in sorted(found[heading])])
            for heading, _ in OPTION_GROUPS
            if heading in found
        ]

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups = self.option_groups(ctx)
        # every section's text starts in the same column, as in one list
        terms = [term for _, records in groups for term, _ in records]
        width = min(max((len(term) for term in terms), default=0), TERM_MAX)
        for heading, records in groups:
            with formatter.section(heading):
                write_records(formatter, records, width)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_epilog(ctx, formatter)
        formatter.write_paragraph()
        formatter.write(f"Full manual: {self.manual} (and docs/ in the repository)\n")


def grouped_name(param: click.Parameter, ctx: click.Context) -> str:
    """The name ``OPTION_GROUPS`` knows ``param`` by: its own, or ``help`` for -h/--help
    (click names that one as it likes)."""
    if set(param.opts) == set(ctx.help_option_names):
        return "help"
    return param.name or ""


def write_records(
    formatter: click.HelpFormatter, records: list[tuple[str, str]], width: int
) -> None:
    """click's ``write_dl`` with the text column at ``width``, words never split at a
    hyphen (``--on-hang`` stays whole, where click would break it after ``--on-``) and
    click's ``[default: 10.0; x>=0.1]`` kept on one line."""
    import re
    import textwrap  # (here: only --help needs them, not a job's start)

    indent = " " * formatter.current_indent
    text_column = indent + " " * (width + COLUMN_GAP)
    text_width = max(formatter.width - width - COLUMN_GAP - 2, 10)  # (as click's write_dl)
    for term, text in records:
        glued = re.sub(r"\[[^]]*\]", lambda m: m[0].replace(" ", GLUE), text)
        wrapped = textwrap.wrap(glued, text_width, break_on_hyphens=False) or [""]
        lines = [line.replace(GLUE, " ") for line in wrapped]
        if len(term) <= width:
            formatter.write(f"{indent}{term.ljust(width + COLUMN_GAP)}{lines[0]}\n")
        else:  # a long option: its text starts on the next line
            formatter.write(f"{indent}{term}\n{text_column}{lines[0]}\n")
        for line in lines[1:]:
            formatter.write(f"{text_column}{line}\n")
