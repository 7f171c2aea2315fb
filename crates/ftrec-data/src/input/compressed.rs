//! Text inputs that may be compressed: Criteo's day files ship gzipped, and zstd mirrors
//! exist. The format is told by the file's magic bytes, never by its name, so `day_0`,
//! `day_0.gz` and a renamed download all read the same.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use ruzstd::decoding::{FrameDecoder, StreamingDecoder};

use crate::DataError;

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];
const BUFFER: usize = 1 << 20;

/// How a file's bytes are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    pub fn of(head: &[u8]) -> Self {
        if head.starts_with(&ZSTD_MAGIC) {
            Self::Zstd
        } else if head.starts_with(&GZIP_MAGIC) {
            Self::Gzip
        } else {
            Self::None
        }
    }
}

/// `path` as a buffered stream of its decompressed text.
pub fn open_text(path: &Path) -> Result<Box<dyn BufRead>, DataError> {
    let file = File::open(path).map_err(|e| DataError::io(path, e))?;
    let mut raw = BufReader::with_capacity(BUFFER, file);
    let kind =
        Compression::of(peek(&mut raw, ZSTD_MAGIC.len()).map_err(|e| DataError::io(path, e))?);
    Ok(match kind {
        Compression::None => Box::new(raw),
        // Multi-member: `cat a.gz b.gz` and bgzip-style files are one stream.
        Compression::Gzip => Box::new(BufReader::with_capacity(
            BUFFER,
            flate2::bufread::MultiGzDecoder::new(raw),
        )),
        Compression::Zstd => {
            let decoder = StreamingDecoder::new(raw)
                .map_err(|e| DataError::format(path, format!("not a readable zstd stream: {e}")))?;
            Box::new(BufReader::with_capacity(
                BUFFER,
                ZstdFrames {
                    inner: Some(decoder),
                },
            ))
        }
    })
}

/// Up to `n` leading bytes without consuming them (fewer only at end of file).
fn peek<R: Read>(reader: &mut BufReader<R>, n: usize) -> std::io::Result<&[u8]> {
    // A fresh 1 MiB buffer is filled by one read; a short first read of a regular file
    // would only make a compressed file read as text, which its parse errors then show.
    let head = reader.fill_buf()?;
    Ok(&head[..head.len().min(n)])
}

/// Every frame of a zstd stream in turn (`zstd` splits large inputs into several frames,
/// and `cat a.zst b.zst` is valid too); ruzstd's decoder reads one.
struct ZstdFrames<R: BufRead> {
    inner: Option<StreamingDecoder<R, FrameDecoder>>,
}

impl<R: BufRead> Read for ZstdFrames<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let Some(decoder) = self.inner.as_mut() else {
                return Ok(0);
            };
            let n = decoder.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            let Some(decoder) = self.inner.take() else {
                return Ok(0);
            };
            let (mut source, frame) = decoder.into_parts();
            if source.fill_buf()?.is_empty() {
                return Ok(0);
            }
            let next = StreamingDecoder::new_with_decoder(source, frame)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
            self.inner = Some(next);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn read_all(path: &Path) -> String {
        let mut s = String::new();
        open_text(path).unwrap().read_to_string(&mut s).unwrap();
        s
    }

    #[test]
    fn gzip_and_zstd_are_read_by_their_magic_not_their_name() {
        let dir = tempfile::tempdir().unwrap();
        let text = "1\t2\n3\t4\n".repeat(1000);
        let plain = dir.path().join("plain.gz");
        std::fs::write(&plain, &text).unwrap();
        assert_eq!(read_all(&plain), text, "a .gz name alone is not gzip");

        let gz = dir.path().join("day_0");
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(text.as_bytes()).unwrap();
        let member = enc.finish().unwrap();
        // Two members concatenated read as one stream.
        std::fs::write(&gz, [member.clone(), member].concat()).unwrap();
        assert_eq!(read_all(&gz), text.repeat(2));

        let zst = dir.path().join("day_1.bin");
        let frame = ruzstd::encoding::compress_to_vec(
            text.as_bytes(),
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        std::fs::write(&zst, [frame.clone(), frame].concat()).unwrap();
        assert_eq!(read_all(&zst), text.repeat(2));
    }

    #[test]
    fn a_corrupt_stream_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("broken");
        std::fs::write(&bad, [0x28, 0xb5, 0x2f, 0xfd, 0xff, 0xff]).unwrap();
        let e = open_text(&bad).err().unwrap().to_string();
        assert!(e.contains("broken") && e.contains("zstd"), "{e}");
        let gz = dir.path().join("cut.gz");
        std::fs::write(&gz, [0x1f, 0x8b, 8, 0, 0, 0]).unwrap();
        let mut s = String::new();
        assert!(open_text(&gz).unwrap().read_to_string(&mut s).is_err());
    }
}
