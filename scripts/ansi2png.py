#!/usr/bin/env python3
"""Render a terminal capture with ANSI colours (`tmux capture-pane -e -p`) to a PNG.

Used for the README screenshot:

    tmux new-session -d -s hr -x 120 -y 36 'target/release/headroom train --steps 2000'
    sleep 20; tmux capture-pane -e -p -t hr > screen.ansi
    python3 scripts/ansi2png.py screen.ansi docs/dashboard.png   # needs pillow
"""
import re
import sys

from PIL import Image, ImageDraw, ImageFont

FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf"
BOLD = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono-Bold.ttf"
# The mono face has no braille (ratatui's chart dots); the proportional one does.
BRAILLE = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
BASE = [
    (30, 30, 30), (205, 49, 49), (13, 188, 121), (229, 229, 16),
    (36, 114, 200), (188, 63, 188), (17, 168, 205), (204, 204, 204),
    (102, 102, 102), (241, 76, 76), (35, 209, 139), (245, 245, 67),
    (59, 142, 234), (214, 112, 214), (41, 184, 219), (242, 242, 242),
]
FG, BG = (220, 220, 220), (24, 24, 27)


def color256(n):
    if n < 16:
        return BASE[n]
    if n < 232:
        n -= 16
        steps = [0, 95, 135, 175, 215, 255]
        return (steps[n // 36], steps[(n // 6) % 6], steps[n % 6])
    v = 8 + (n - 232) * 10
    return (v, v, v)


def parse(text):
    """Yields rows of (char, fg, bg, bold)."""
    rows = []
    fg, bg, bold, rev = FG, BG, False, False
    for line in text.split("\n"):
        row = []
        for part in re.split(r"(\x1b\[[0-9;]*m)", line):
            m = re.fullmatch(r"\x1b\[([0-9;]*)m", part)
            if not m:
                for ch in part:
                    f, b = (bg, fg) if rev else (fg, bg)
                    row.append((ch, f, b, bold))
                continue
            codes = [int(c) if c else 0 for c in m.group(1).split(";")]
            i = 0
            while i < len(codes):
                c = codes[i]
                if c == 0:
                    fg, bg, bold, rev = FG, BG, False, False
                elif c == 1:
                    bold = True
                elif c == 22:
                    bold = False
                elif c == 7:
                    rev = True
                elif c == 27:
                    rev = False
                elif 30 <= c <= 37:
                    fg = BASE[c - 30]
                elif 90 <= c <= 97:
                    fg = BASE[c - 90 + 8]
                elif 40 <= c <= 47:
                    bg = BASE[c - 40]
                elif 100 <= c <= 107:
                    bg = BASE[c - 100 + 8]
                elif c == 39:
                    fg = FG
                elif c == 49:
                    bg = BG
                elif c in (38, 48) and i + 1 < len(codes):
                    if codes[i + 1] == 5 and i + 2 < len(codes):
                        col = color256(codes[i + 2])
                        i += 2
                    elif codes[i + 1] == 2 and i + 4 < len(codes):
                        col = tuple(codes[i + 2:i + 5])
                        i += 4
                    else:
                        col = FG if c == 38 else BG
                    if c == 38:
                        fg = col
                    else:
                        bg = col
                i += 1
        rows.append(row)
    while rows and not rows[-1]:
        rows.pop()
    return rows


def main(src, dst):
    rows = parse(open(src, encoding="utf-8").read())
    size = 16
    font, bold = ImageFont.truetype(FONT, size), ImageFont.truetype(BOLD, size)
    braille = ImageFont.truetype(BRAILLE, size)
    cw = int(font.getlength("M"))
    ch = int(size * 1.25)
    width = max(len(r) for r in rows)
    img = Image.new("RGB", (width * cw + 16, len(rows) * ch + 16), BG)
    draw = ImageDraw.Draw(img)
    for y, row in enumerate(rows):
        for x, (c, f, b, is_bold) in enumerate(row):
            px, py = 8 + x * cw, 8 + y * ch
            if b != BG:
                draw.rectangle([px, py, px + cw, py + ch], fill=b)
            if c != " ":
                face = bold if is_bold else font
                if 0x2800 <= ord(c) <= 0x28FF:
                    face = braille
                draw.text((px, py), c, font=face, fill=f)
    img.save(dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
