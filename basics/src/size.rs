//! Sizes as people write them: parsed from `65536`, `64K`, `64KiB`, `512MiB`, `2 GiB` (binary
//! multiples, any case), and written back either exactly (`512 MiB`, `1000 bytes`: for a
//! limit a person set) or rounded (`64.0 MiB`: for a measured amount).

/// A size that does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SizeError {
    /// The text is not a size such as `65536`, `64K`, `64KiB` or `1MiB`.
    #[error("`{text}` is not a size (examples: 65536, 64KiB, 1MiB)")]
    Unparsable {
        /// The text as given.
        text: String,
    },
    /// The value does not fit in 64 bits.
    #[error("`{text}` is too large")]
    Overflow {
        /// The text as given.
        text: String,
    },
}

/// Parses `N`, `NK`, `NKiB`, `NM`, `NMiB`, `NG`, `NGiB`, `NT`, `NTiB` (binary multiples,
/// case-insensitive, spaces allowed around the unit), bytes.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let unparsable = || SizeError::Unparsable {
        text: text.to_owned(),
    };
    let overflow = || SizeError::Overflow {
        text: text.to_owned(),
    };
    let trimmed = text.trim();
    let digits_end = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    if digits_end == 0 {
        return Err(unparsable());
    }
    let number: u64 = trimmed[..digits_end].parse().map_err(|_| overflow())?;
    let shift = match trimmed[digits_end..].trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(unparsable()),
    };
    number.checked_mul(1u64 << shift).ok_or_else(overflow)
}

/// A measured amount with a binary unit, rounded to one decimal: `64.0 MiB`, `512 B`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    #[allow(
        clippy::cast_precision_loss,
        reason = "rounded to one decimal for people to read"
    )]
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A size as a person writes it, exactly: `64 MiB`, `1 GiB`, `1025 MiB`, `1000 bytes` (the
/// largest unit it is a whole number of).
pub fn size_text(bytes: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    format!("{bytes} bytes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parse_size_units_scale_binary() {
        assert_eq!(parse_size("65536"), Ok(65536));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2 gib"), Ok(2 << 30));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
    }

    #[test]
    fn parse_size_garbage_is_rejected_with_the_text() {
        let err = parse_size("512XB").unwrap_err();
        assert!(err.to_string().contains("512XB"), "{err}");
        assert!(parse_size("").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("-1").is_err());
        assert!(matches!(
            parse_size("99999999999999999999"),
            Err(SizeError::Overflow { .. })
        ));
        assert!(matches!(
            parse_size("99999999999TiB"),
            Err(SizeError::Overflow { .. })
        ));
    }

    #[test]
    fn format_bytes_rounds_to_one_decimal_of_the_largest_unit() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(64 << 20), "64.0 MiB");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(u64::MAX), "16777216.0 TiB");
    }

    #[test]
    fn size_text_whole_units_are_named_and_others_are_bytes() {
        assert_eq!(size_text(64 << 20), "64 MiB");
        assert_eq!(size_text(1 << 30), "1 GiB");
        assert_eq!(size_text(3 << 10), "3 KiB");
        assert_eq!(size_text(1000), "1000 bytes");
        assert_eq!(size_text((1 << 30) + (1 << 20)), "1025 MiB");
        assert_eq!(size_text(0), "0 bytes");
    }

    proptest! {
        #[test]
        fn size_text_parses_back_to_the_same_size(bytes in any::<u64>()) {
            let text = size_text(bytes).replace(" bytes", "");
            prop_assert_eq!(parse_size(&text), Ok(bytes));
        }
    }
}
