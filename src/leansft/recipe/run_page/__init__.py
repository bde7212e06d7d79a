"""The run page: a run's figures, samples, checkpoints, data report and config in a browser, live while it trains
(``leansft report RUN --serve``, ``leansft train ... --serve``) or written once as report.html (``leansft report``).
One renderer (static/page.js) for both."""
