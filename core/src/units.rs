//! Human-readable byte sizes, both ways.

/// Formats bytes with binary units: `512 B`, `1.5 KiB`, `6.00 GiB`.
pub fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{bytes} B"),
        _ if value >= 100.0 => format!("{value:.0} {}", UNITS[unit]),
        _ if value >= 10.0 => format!("{value:.1} {}", UNITS[unit]),
        _ => format!("{value:.2} {}", UNITS[unit]),
    }
}

/// Parses `6GiB`, `512MiB`, `1.5G`, `2GB`, `1024` (bytes). `KiB`/`MiB`/`GiB`/`TiB` and the
/// bare letters (`6G`, as `free -g` and docker mean it) are powers of 1024; `KB`/`MB`/`GB`/
/// `TB` are powers of 1000, as a disk's label and `ls --si` mean them: "2GB" is 2·10^9
/// bytes (1.86 GiB), not 2 GiB. Whoever shows the result shows it in binary units, so the
/// reader sees which was taken.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("'{text}' is not a size; write e.g. 6GiB, 512MiB or 1048576"))?;
    let mult: u64 = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "'{text}' has an unknown unit '{other}'; use B, KiB, MiB, GiB or TiB (powers \
                 of 1024), or KB, MB, GB or TB (powers of 1000)"
            ))
        }
    };
    let bytes = value * mult as f64;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(format!("'{text}' is out of range; give a positive size"));
    }
    Ok(bytes as u64)
}

/// `65,000`: a count grouped by thousands, for steps and samples a reader compares at a
/// glance.
pub fn fmt_count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `1m05s`, `3h02m`, `42s`: compact durations for the header and progress lines.
pub fn fmt_duration(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "--".into();
    }
    let s = secs.round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// Steele, Lea & Flood's SplitMix64 finalizer: cheap, and every input bit reaches every
/// output bit, so neighbouring inputs (steps, sample indices) land far apart.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// How `effective` sequences split into micro-batches of `micro`, written so that it
/// multiplies out: "64 × 4 = 256", or with an uneven last one "78 × 3 + 22 = 256".
pub fn fmt_split(micro: usize, effective: usize) -> String {
    let micro = micro.max(1);
    let (full, rest) = (effective / micro, effective % micro);
    match (full, rest) {
        (0, _) => format!("{effective} = {effective}"),
        (_, 0) => format!("{micro} × {full} = {effective}"),
        _ => format!("{micro} × {full} + {rest} = {effective}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_always_multiplies_out() {
        assert_eq!(fmt_split(64, 256), "64 × 4 = 256");
        assert_eq!(fmt_split(163, 512), "163 × 3 + 23 = 512");
        assert_eq!(fmt_split(14, 256), "14 × 18 + 4 = 256");
        assert_eq!(fmt_split(256, 256), "256 × 1 = 256");
    }

    #[test]
    fn formats_bytes_at_unit_boundaries() {
        assert_eq!(fmt_bytes(0), "0 B");
        assert_eq!(fmt_bytes(1023), "1023 B");
        assert_eq!(fmt_bytes(1024), "1.00 KiB");
        assert_eq!(fmt_bytes(1536 * 1024), "1.50 MiB");
        assert_eq!(fmt_bytes(80 * (1 << 30)), "80.0 GiB");
        assert_eq!(fmt_bytes(200 * (1 << 30)), "200 GiB");
    }

    #[test]
    fn parses_sizes_and_rejects_garbage() {
        assert_eq!(parse_bytes("6GiB").unwrap(), 6 << 30);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_bytes(" 800mib ").unwrap(), 800 << 20);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert!(parse_bytes("six gigs").unwrap_err().contains("not a size"));
        assert!(parse_bytes("6XB").unwrap_err().contains("unknown unit"));
        assert!(parse_bytes("0").unwrap_err().contains("out of range"));
    }

    /// "2GB" is what a disk's label means by it, 2·10^9 bytes; "2GiB" and "2G" are 2^31.
    #[test]
    fn si_units_are_powers_of_1000_and_binary_ones_of_1024() {
        assert_eq!(parse_bytes("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_bytes("800mb").unwrap(), 800_000_000);
        assert_eq!(parse_bytes("1.5TB").unwrap(), 1_500_000_000_000);
        assert_eq!(parse_bytes("64KB").unwrap(), 64_000);
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("2G").unwrap(), 2 << 30);
        assert_eq!(fmt_bytes(parse_bytes("2GB").unwrap()), "1.86 GiB");
        let e = parse_bytes("2XB").unwrap_err();
        assert!(e.contains("GiB") && e.contains("GB"), "{e}");
    }

    #[test]
    fn counts_are_grouped_by_thousands() {
        assert_eq!(fmt_count(0), "0");
        assert_eq!(fmt_count(999), "999");
        assert_eq!(fmt_count(1000), "1,000");
        assert_eq!(fmt_count(65_000), "65,000");
        assert_eq!(fmt_count(1_234_567), "1,234,567");
    }

    #[test]
    fn formats_durations() {
        assert_eq!(fmt_duration(42.4), "42s");
        assert_eq!(fmt_duration(65.0), "1m05s");
        assert_eq!(fmt_duration(3.0 * 3600.0 + 120.0), "3h02m");
        assert_eq!(fmt_duration(f64::NAN), "--");
    }
}
