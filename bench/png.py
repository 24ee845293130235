"""Just enough raster drawing for benchmark charts: filled rectangles, lines, a 5x7
bitmap font (upper case) and a PNG writer, on a numpy RGB array. Plotting libraries
are not among our dependencies, and these charts need nothing more."""

import struct
import zlib
from pathlib import Path

import numpy as np

Color = tuple[int, int, int]
BLACK, GREY, LIGHT, WHITE = (30, 30, 30), (140, 140, 140), (225, 225, 225), (255, 255, 255)
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (188, 189, 34), (23, 190, 207)]  # fmt: skip

# Each glyph: 7 rows of 5 bits, the leftmost pixel in the highest bit.
GLYPHS = {
    "0": "0E11131519110E", "1": "040C040404040E", "2": "0E11010204081F", "3": "1F02040201110E",
    "4": "02060A121F0202", "5": "1F101E0101110E", "6": "0608101E11110E", "7": "1F010204080808",
    "8": "0E11110E11110E", "9": "0E11110F01020C", "A": "0E1111111F1111", "B": "1E11111E11111E",
    "C": "0E11101010110E", "D": "1C12111111121C", "E": "1F10101E10101F", "F": "1F10101E101010",
    "G": "0E11101711110F", "H": "1111111F111111", "I": "0E04040404040E",
    "J": "0702020202120C", "K": "11121418141211", "L": "1010101010101F",
    "M": "111B1515111111", "N": "11111915131111", "O": "0E11111111110E", "P": "1E11111E101010",
    "Q": "0E11111115120D", "R": "1E11111E141211", "S": "0F10100E01011E", "T": "1F040404040404",
    "U": "1111111111110E", "V": "11111111110A04", "W": "1111111515150A", "X": "11110A040A1111",
    "Y": "1111110A040404", "Z": "1F01020408101F", " ": "00000000000000", ".": "00000000000C0C",
    ",": "000000000C0408", ":": "000C0C000C0C00", "%": "18190204081303", "/": "00010204081000",
    "(": "02040808080402", ")": "08040202020408", "-": "0000001F000000", "+": "0004041F040400",
    "=": "00001F001F0000", ">": "08040201020408", "<": "02040810080402", "_": "0000000000001F",
    "'": "0C040800000000",
}  # fmt: skip


class Canvas:
    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        self.pixels = np.empty((height, width, 3), np.uint8)
        self.pixels[:] = background

    def rect(self, x0: float, y0: float, x1: float, y1: float, color: Color) -> None:
        h, w = self.pixels.shape[:2]
        xs = slice(max(0, round(x0)), min(w, max(round(x1), round(x0) + 1)))
        ys = slice(max(0, round(y0)), min(h, max(round(y1), round(y0) + 1)))
        self.pixels[ys, xs] = color

    def line(self, x0: float, y0: float, x1: float, y1: float, color: Color, width: int = 1):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for x, y in zip(np.linspace(x0, x1, n), np.linspace(y0, y1, n), strict=True):
            x, y = x - width // 2, y - width // 2
            self.rect(x, y, x + width, y + width, color)

    def text(self, x: float, y: float, text: str, color: Color = BLACK, scale: int = 2,
             align: str = "left") -> None:  # fmt: skip
        """Draws upper-cased text with its top at y; align is left, center or right."""
        advance = 6 * scale
        x -= {"left": 0, "center": len(text) * advance / 2, "right": len(text) * advance}[align]
        for i, char in enumerate(text.upper()):
            rows = bytes.fromhex(GLYPHS.get(char, GLYPHS[" "]))
            for r, bits in enumerate(rows):
                for c in range(5):
                    if bits >> (4 - c) & 1:
                        px, py = x + i * advance + c * scale, y + r * scale
                        self.rect(px, py, px + scale, py + scale, color)

    def save(self, path: Path) -> None:
        h, w = self.pixels.shape[:2]
        rows = np.concatenate([np.zeros((h, 1), np.uint8), self.pixels.reshape(h, w * 3)], axis=1)

        def chunk(kind: bytes, data: bytes) -> bytes:
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        Path(path).write_bytes(
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
            + chunk(b"IEND", b"")
        )
