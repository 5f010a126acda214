"""Figures: their numbers computed once (``figure_data``), drawn as PNG (``plots``) and as Vega-Lite (``html_figures``)."""
