//! Writing float32 arrays as NumPy `.npy` (format version 1.0), atomically.

use std::io::Write;
use std::path::Path;

/// Write `data` (row-major, `shape`) as a little-endian float32 `.npy` file. Writes to a
/// temporary name beside `path` and renames, so no partial file is left behind.
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> std::io::Result<()> {
    let n: usize = shape.iter().product();
    if n != data.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("npy: shape {shape:?} holds {n} values, got {}", data.len()),
        ));
    }
    let dims = match shape.len() {
        1 => format!("({},)", shape[0]),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {dims}, }}");
    // magic(6) + version(2) + header length(2) + header, padded with spaces to 64 bytes, ending in \n.
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let tmp = path.with_extension("npy.tmp");
    let result = (|| {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        f.write_all(b"\x93NUMPY\x01\x00")?;
        f.write_all(&(header.len() as u16).to_le_bytes())?;
        f.write_all(header.as_bytes())?;
        for v in data {
            f.write_all(&v.to_le_bytes())?;
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Read a float32 `.npy` written by NumPy or by [`write_f32`]: (shape, data).
pub fn read_f32(path: &Path) -> std::io::Result<(Vec<usize>, Vec<f32>)> {
    let bad = |m: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: {m}", path.display()),
        )
    };
    let bytes = std::fs::read(path)?;
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file"));
    }
    let (hlen, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        _ => return Err(bad("unsupported .npy version")),
    };
    let header = std::str::from_utf8(
        bytes
            .get(start..start + hlen)
            .ok_or_else(|| bad("header past end"))?,
    )
    .map_err(|_| bad("header not UTF-8"))?;
    if !header.contains("'descr': '<f4'") || header.contains("'fortran_order': True") {
        return Err(bad("only C-order little-endian float32 is supported"));
    }
    let s = header.find("'shape': (").ok_or_else(|| bad("no shape"))? + 10;
    let e = header[s..].find(')').ok_or_else(|| bad("bad shape"))? + s;
    let shape: Vec<usize> = header[s..e]
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| x.parse().map_err(|_| bad("bad shape")))
        .collect::<Result<_, _>>()?;
    let body = &bytes[start + hlen..];
    let n: usize = shape.iter().product();
    if body.len() != n * 4 {
        return Err(bad("data length does not match shape"));
    }
    Ok((
        shape,
        body.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip() {
        let dir = std::env::temp_dir().join(format!("sluice-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.npy");
        super::write_f32(&p, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.5]).unwrap();
        let (shape, data) = super::read_f32(&p).unwrap();
        assert_eq!(shape, vec![2, 3]);
        assert_eq!(data[5], 6.5);
        assert_eq!(std::fs::read(&p).unwrap().len() % 64, 24); // 64-byte header + 24 data bytes
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
