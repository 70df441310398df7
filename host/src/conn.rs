//! One connection of the stream protocol, on either transport, read a bounded line at a
//! time.
use std::io::{self, BufRead, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// A connection on either transport.
pub enum Conn {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Conn {
    pub fn try_clone(&self) -> io::Result<Conn> {
        Ok(match self {
            Conn::Unix(s) => Conn::Unix(s.try_clone()?),
            Conn::Tcp(s) => Conn::Tcp(s.try_clone()?),
        })
    }
    pub fn set_read_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Unix(s) => s.set_read_timeout(d),
            Conn::Tcp(s) => s.set_read_timeout(d),
        }
    }
    pub fn set_write_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Unix(s) => s.set_write_timeout(d),
            Conn::Tcp(s) => s.set_write_timeout(d),
        }
    }
    /// Says "no more from us" while still reading: the other side sees the end of the
    /// stream after what was sent.
    pub fn shutdown_write(&self) {
        let _ = match self {
            Conn::Unix(s) => s.shutdown(std::net::Shutdown::Write),
            Conn::Tcp(s) => s.shutdown(std::net::Shutdown::Write),
        };
    }

    pub fn close(&self) {
        let _ = match self {
            Conn::Unix(s) => s.shutdown(std::net::Shutdown::Both),
            Conn::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }
    pub fn peer(&self) -> String {
        match self {
            Conn::Unix(_) => "unix socket".into(),
            Conn::Tcp(s) => s
                .peer_addr()
                .map_or_else(|_| "tcp".into(), |a| a.to_string()),
        }
    }
    /// The uid of the process at the other end of a Unix socket.
    pub fn peer_uid(&self) -> Option<u32> {
        let Conn::Unix(s) = self else { return None };
        use std::os::fd::AsRawFd;
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: a valid socket and an out-buffer of the size given.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                &mut cred as *mut libc::ucred as *mut libc::c_void,
                &mut len,
            )
        };
        (r == 0).then_some(cred.uid)
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Unix(s) => s.read(buf),
            Conn::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Unix(s) => s.write(buf),
            Conn::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Conn::Unix(s) => s.flush(),
            Conn::Tcp(s) => s.flush(),
        }
    }
}

/// Writes one protocol line; errors end the connection anyway.
pub fn send_line(conn: &mut Conn, line: &str) -> io::Result<()> {
    conn.write_all(line.as_bytes())?;
    conn.write_all(b"\n")?;
    conn.flush()
}

/// Reads one line of at most `limit` bytes (without the newline). `Ok(None)` at the end
/// of the stream; an error of kind `InvalidData` for a line that is too long, after which
/// the connection must be closed (the rest of that line is never read).
pub fn read_line_limited(r: &mut impl BufRead, limit: usize) -> io::Result<Option<String>> {
    let mut line = Vec::new();
    loop {
        let buf = r.fill_buf()?;
        if buf.is_empty() {
            return Ok((!line.is_empty()).then(|| String::from_utf8_lossy(&line).into()));
        }
        let (chunk, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], Some(i + 1)),
            None => (buf, None),
        };
        if line.len() + chunk.len() > limit {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a line longer than {limit} bytes"),
            ));
        }
        line.extend_from_slice(chunk);
        let used = done.unwrap_or(buf.len());
        r.consume(used);
        if done.is_some() {
            return Ok(Some(String::from_utf8_lossy(&line).into()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufReader;

    #[test]
    fn a_line_over_the_limit_is_refused_without_reading_it_all() {
        let mut r = BufReader::with_capacity(16, io::Cursor::new(vec![b'x'; 1 << 20]));
        let e = read_line_limited(&mut r, 1000).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(r.get_ref().position() < 2000, "stopped reading early");
        let mut ok = BufReader::new(io::Cursor::new(b"ab\ncd".to_vec()));
        assert_eq!(
            read_line_limited(&mut ok, 10).unwrap().as_deref(),
            Some("ab")
        );
        assert_eq!(
            read_line_limited(&mut ok, 10).unwrap().as_deref(),
            Some("cd")
        );
        assert_eq!(read_line_limited(&mut ok, 10).unwrap(), None);
    }
}

/// Where a client connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Unix(std::path::PathBuf),
    Tcp(String),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Unix(p) => write!(f, "{}", p.display()),
            Target::Tcp(a) => write!(f, "{a}"),
        }
    }
}

impl Conn {
    /// Connects within `timeout`.
    pub fn connect(target: &Target, timeout: Duration) -> io::Result<Conn> {
        match target {
            Target::Unix(p) => UnixStream::connect(p).map(Conn::Unix),
            Target::Tcp(a) => {
                let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{a}: no address"));
                for addr in std::net::ToSocketAddrs::to_socket_addrs(a.as_str())? {
                    match TcpStream::connect_timeout(&addr, timeout) {
                        Ok(s) => {
                            let _ = s.set_nodelay(true);
                            return Ok(Conn::Tcp(s));
                        }
                        Err(e) => last = e,
                    }
                }
                Err(last)
            }
        }
    }
}
