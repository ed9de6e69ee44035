// The operand of ldtilecfg (AMX tile configuration), shared by every unit that uses tiles;
// included once per unit, inside its namespace.

struct TileConfig {  // ldtilecfg's 64-byte operand, palette 1
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile register 16 rows x 64 bytes (the shape of all tiles of the prefill and chunk
// kernels), loaded into the tile unit.
static inline void configure_full_tiles(TileConfig* cfg) {
  __builtin_memset(cfg, 0, sizeof(*cfg));
  cfg->palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg->rows[t] = 16;
    cfg->colsb[t] = 64;
  }
  _tile_loadconfig(cfg);
}
