//! A small, safe reader for the pickles torch's JIT pickler writes (protocol 2, as in
//! `torch::cuda::_memory_snapshot_pickled`), plus the common protocol-4 opcodes Python
//! emits, so test vectors can come from Python's `pickle`. It builds plain values and
//! never executes anything: a GLOBAL + REDUCE becomes its first argument (torch's
//! `build_intlist` and friends wrap a list that way) or an opaque marker.
use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    /// A global that was referenced but not applied.
    Global(String, String),
    /// Something this reader does not model.
    Opaque,
}

impl Value {
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => items
                .iter()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Int(i) if *i >= 0 => Some(*i as u64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_list(&self) -> Option<&[Value]> {
        match self {
            Value::List(v) | Value::Tuple(v) => Some(v),
            _ => None,
        }
    }
}

enum Item {
    Mark,
    Val(Value),
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.data.len())
            .ok_or_else(|| format!("pickle truncated at byte {}", self.pos))?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn line(&mut self) -> Result<String, String> {
        let rest = &self.data[self.pos..];
        let n = rest
            .iter()
            .position(|b| *b == b'\n')
            .ok_or("pickle: unterminated line")?;
        let s = String::from_utf8_lossy(&rest[..n]).into_owned();
        self.pos += n + 1;
        Ok(s)
    }
    fn string(&mut self, n: usize) -> Result<Value, String> {
        Ok(Value::Str(
            String::from_utf8_lossy(self.take(n)?).into_owned(),
        ))
    }
}

/// Little-endian two's-complement integer of any width (LONG1 / LONG4).
fn long(bytes: &[u8]) -> Value {
    if bytes.len() > 8 {
        return Value::Opaque;
    }
    let mut buf = if bytes.last().is_some_and(|b| b & 0x80 != 0) {
        [0xffu8; 8]
    } else {
        [0u8; 8]
    };
    buf[..bytes.len()].copy_from_slice(bytes);
    Value::Int(i64::from_le_bytes(buf))
}

pub fn parse(data: &[u8]) -> Result<Value, String> {
    let mut r = Reader { data, pos: 0 };
    let mut stack: Vec<Item> = Vec::new();
    let mut memo: HashMap<u32, Value> = HashMap::new();
    let pop = |stack: &mut Vec<Item>| -> Result<Value, String> {
        match stack.pop() {
            Some(Item::Val(v)) => Ok(v),
            _ => Err("pickle: stack underflow".into()),
        }
    };
    let pop_mark = |stack: &mut Vec<Item>| -> Result<Vec<Value>, String> {
        let mut items = Vec::new();
        loop {
            match stack.pop() {
                Some(Item::Val(v)) => items.push(v),
                Some(Item::Mark) => break,
                None => return Err("pickle: MARK missing".into()),
            }
        }
        items.reverse();
        Ok(items)
    };
    loop {
        let op = r.u8()?;
        match op {
            0x80 => {
                r.u8()?; // PROTO n
            }
            0x95 => {
                r.take(8)?; // FRAME
            }
            b'.' => return pop(&mut stack), // STOP
            b'(' => stack.push(Item::Mark),
            b'N' => stack.push(Item::Val(Value::None)),
            0x88 => stack.push(Item::Val(Value::Bool(true))),
            0x89 => stack.push(Item::Val(Value::Bool(false))),
            b'K' => stack.push(Item::Val(Value::Int(r.u8()? as i64))),
            b'M' => stack.push(Item::Val(Value::Int(r.u16()? as i64))),
            b'J' => stack.push(Item::Val(Value::Int(r.u32()? as i32 as i64))),
            0x8a => {
                let n = r.u8()? as usize;
                stack.push(Item::Val(long(r.take(n)?)));
            }
            0x8b => {
                let n = r.u32()? as usize;
                stack.push(Item::Val(long(r.take(n)?)));
            }
            b'G' => {
                let b: [u8; 8] = r.take(8)?.try_into().expect("8 bytes");
                stack.push(Item::Val(Value::Float(f64::from_be_bytes(b))));
            }
            b'X' => {
                let n = r.u32()? as usize;
                stack.push(Item::Val(r.string(n)?));
            }
            0x8c => {
                let n = r.u8()? as usize;
                stack.push(Item::Val(r.string(n)?));
            }
            b'U' => {
                let n = r.u8()? as usize;
                stack.push(Item::Val(r.string(n)?)); // SHORT_BINSTRING
            }
            b'T' => {
                let n = r.u32()? as usize;
                stack.push(Item::Val(r.string(n)?)); // BINSTRING
            }
            b'C' => {
                let n = r.u8()? as usize;
                stack.push(Item::Val(Value::Bytes(r.take(n)?.to_vec())));
            }
            b'B' => {
                let n = r.u32()? as usize;
                stack.push(Item::Val(Value::Bytes(r.take(n)?.to_vec())));
            }
            b'}' => stack.push(Item::Val(Value::Dict(Vec::new()))),
            b']' => stack.push(Item::Val(Value::List(Vec::new()))),
            b')' => stack.push(Item::Val(Value::Tuple(Vec::new()))),
            b'd' => {
                let items = pop_mark(&mut stack)?;
                let mut pairs = Vec::new();
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    pairs.push((k, v));
                }
                stack.push(Item::Val(Value::Dict(pairs)));
            }
            b'l' => {
                let items = pop_mark(&mut stack)?;
                stack.push(Item::Val(Value::List(items)));
            }
            b't' => {
                let items = pop_mark(&mut stack)?;
                stack.push(Item::Val(Value::Tuple(items)));
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(pop(&mut stack)?);
                }
                items.reverse();
                stack.push(Item::Val(Value::Tuple(items)));
            }
            b'u' => {
                let items = pop_mark(&mut stack)?;
                let Some(Item::Val(Value::Dict(d))) = stack.last_mut() else {
                    return Err("pickle: SETITEMS without a dict".into());
                };
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    d.push((k, v));
                }
            }
            b's' => {
                let v = pop(&mut stack)?;
                let k = pop(&mut stack)?;
                let Some(Item::Val(Value::Dict(d))) = stack.last_mut() else {
                    return Err("pickle: SETITEM without a dict".into());
                };
                d.push((k, v));
            }
            b'e' => {
                let items = pop_mark(&mut stack)?;
                let Some(Item::Val(Value::List(l))) = stack.last_mut() else {
                    return Err("pickle: APPENDS without a list".into());
                };
                l.extend(items);
            }
            b'a' => {
                let v = pop(&mut stack)?;
                let Some(Item::Val(Value::List(l))) = stack.last_mut() else {
                    return Err("pickle: APPEND without a list".into());
                };
                l.push(v);
            }
            b'q' => {
                let i = r.u8()? as u32;
                memo_put(&stack, &mut memo, i)?;
            }
            b'r' => {
                let i = r.u32()?;
                memo_put(&stack, &mut memo, i)?;
            }
            0x94 => {
                let i = memo.len() as u32;
                memo_put(&stack, &mut memo, i)?;
            }
            b'h' => {
                let i = r.u8()? as u32;
                stack.push(Item::Val(memo_get(&memo, i)?));
            }
            b'j' => {
                let i = r.u32()?;
                stack.push(Item::Val(memo_get(&memo, i)?));
            }
            b'c' => {
                let module = r.line()?;
                let name = r.line()?;
                stack.push(Item::Val(Value::Global(module, name)));
            }
            0x93 => {
                let name = pop(&mut stack)?;
                let module = pop(&mut stack)?;
                let text = |v: Value| match v {
                    Value::Str(s) => s,
                    _ => String::new(),
                };
                stack.push(Item::Val(Value::Global(text(module), text(name))));
            }
            b'R' => {
                let args = pop(&mut stack)?;
                let _callable = pop(&mut stack)?;
                let first = match args {
                    Value::Tuple(mut a) if !a.is_empty() => a.swap_remove(0),
                    _ => Value::Opaque,
                };
                stack.push(Item::Val(first));
            }
            b'b' => {
                pop(&mut stack)?; // BUILD: state is dropped
            }
            b'0' => {
                stack.pop(); // POP
            }
            other => {
                return Err(format!(
                    "pickle: unsupported opcode 0x{other:02x} at byte {}",
                    r.pos - 1
                ))
            }
        }
    }
}

fn memo_put(stack: &[Item], memo: &mut HashMap<u32, Value>, i: u32) -> Result<(), String> {
    match stack.last() {
        // Containers are memoized empty and filled later; the copy stored here is only
        // read back by BINGET, which the JIT pickler uses for repeated strings.
        Some(Item::Val(v)) => {
            memo.insert(i, v.clone());
            Ok(())
        }
        _ => Err("pickle: PUT with an empty stack".into()),
    }
}

fn memo_get(memo: &HashMap<u32, Value>, i: u32) -> Result<Value, String> {
    memo.get(&i)
        .cloned()
        .ok_or_else(|| format!("pickle: memo {i} missing"))
}
