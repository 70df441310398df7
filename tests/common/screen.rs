//! What a terminal shows after a stream of output: enough of a VT emulator for what the
//! dashboard writes (cursor moves, clears, colours, text), so a test reads the screen a
//! user sees. The raw stream does not do: a redraw writes only the cells that changed,
//! so a line's text is split wherever the old screen already had the same character.
pub struct Screen {
    rows: Vec<Vec<char>>,
    cols: usize,
    row: usize,
    col: usize,
}

impl Screen {
    pub fn new(cols: usize, rows: usize) -> Screen {
        Screen {
            rows: vec![vec![' '; cols]; rows],
            cols,
            row: 0,
            col: 0,
        }
    }

    /// The screen after `bytes`, from a blank one.
    pub fn of(bytes: &str, cols: usize, rows: usize) -> Screen {
        let mut s = Screen::new(cols, rows);
        s.feed(bytes);
        s
    }

    /// Feeds `text` up to its last complete escape sequence, for output read in pieces;
    /// returns the bytes taken (the rest goes first in the next piece).
    pub fn feed_complete(&mut self, text: &str) -> usize {
        let upto = match text.rfind('\x1b') {
            None => text.len(),
            Some(i) => {
                let rest = &text[i + 1..];
                let complete = match rest.chars().next() {
                    None => false,
                    Some('[') => rest[1..].chars().any(|c| ('\x40'..='\x7e').contains(&c)),
                    Some(']') => rest.contains('\x07'),
                    Some(_) => true,
                };
                if complete {
                    text.len()
                } else {
                    i
                }
            }
        };
        self.feed(&text[..upto]);
        upto
    }

    pub fn feed(&mut self, text: &str) {
        let mut it = text.chars().peekable();
        while let Some(c) = it.next() {
            match c {
                '\x1b' => match it.next() {
                    Some('[') => {
                        let mut params = String::new();
                        let mut fin = None;
                        for c in it.by_ref() {
                            if ('\x40'..='\x7e').contains(&c) {
                                fin = Some(c);
                                break;
                            }
                            params.push(c);
                        }
                        self.csi(&params, fin);
                    }
                    // OSC (a title): up to BEL or ST.
                    Some(']') => {
                        while let Some(c) = it.next() {
                            if c == '\x07' || (c == '\x1b' && it.next_if_eq(&'\\').is_some()) {
                                break;
                            }
                        }
                    }
                    _ => {}
                },
                '\r' => self.col = 0,
                '\n' => self.row = (self.row + 1).min(self.rows.len() - 1),
                c if c < ' ' => {}
                c => {
                    if self.col < self.cols {
                        self.rows[self.row][self.col] = c;
                    }
                    self.col += 1;
                }
            }
        }
    }

    fn csi(&mut self, params: &str, fin: Option<char>) {
        if params.starts_with('?') {
            // Modes (alternate screen, cursor shown): entering the alternate screen
            // starts blank.
            if params == "?1049" && fin == Some('h') {
                *self = Screen::new(self.cols, self.rows.len());
            }
            return;
        }
        let n: Vec<usize> = params.split(';').map(|p| p.parse().unwrap_or(0)).collect();
        let at = |i: usize| n.get(i).copied().filter(|v| *v > 0).unwrap_or(1);
        match fin {
            Some('H') | Some('f') => {
                self.row = (at(0) - 1).min(self.rows.len() - 1);
                self.col = at(1) - 1;
            }
            Some('G') => self.col = at(0) - 1,
            Some('C') => self.col += at(0),
            Some('D') => self.col = self.col.saturating_sub(at(0)),
            Some('A') => self.row = self.row.saturating_sub(at(0)),
            Some('B') => self.row = (self.row + at(0)).min(self.rows.len() - 1),
            Some('J') if n.first() == Some(&2) || n.first() == Some(&3) => {
                for r in &mut self.rows {
                    r.fill(' ');
                }
            }
            Some('K') => {
                let from = self.col.min(self.cols);
                self.rows[self.row][from..].fill(' ');
            }
            _ => {}
        }
    }

    /// Every row, trailing blanks cut.
    pub fn text(&self) -> String {
        self.rows
            .iter()
            .map(|r| r.iter().collect::<String>().trim_end().to_string())
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub fn contains(&self, needle: &str) -> bool {
        self.rows
            .iter()
            .any(|r| r.iter().collect::<String>().contains(needle))
    }
}
