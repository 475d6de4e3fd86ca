"""Every text a person reads: terminal lines, Markdown, HTML, and the messages of failures and cells.

The logic modules return data; these modules turn it into text, and all of it goes through the one
escaper in ``harness.render.text``. The rank side imports ``text`` and ``failures`` only.
"""
