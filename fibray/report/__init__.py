"""The report over a trace store: tables printed, PNG plots and one self-contained HTML page.

`python -m fibray.report --store ROOT --out DIR` is the command; `build_report` the function.
"""

from fibray.report.build import Report, Section, build_report, choose_sweep
from fibray.report.tables import to_html, to_text

__all__ = ["Report", "Section", "build_report", "choose_sweep", "to_html", "to_text"]
