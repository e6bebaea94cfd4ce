package volume

import (
	"encoding/json"
	"errors"
	"fmt"
)

// RecordFormat is the format of the volume and snapshot records this
// binary writes, and the newest it reads. A record without a format is
// format 0's (written before records carried one) and reads as format 1
// does. docs/design.md says when the number goes up, and what every
// format keeps so that an older binary can refuse and list its records
// (recordHead).
const RecordFormat = 1

// recordHead is what every format of a record keeps as format 1 has it:
// a JSON object with the format number, and the UUID, name and labels
// that name the record in an older binary's listing.
type recordHead struct {
	Format int               `json:"format"`
	UUID   string            `json:"uuid"`
	Name   string            `json:"name"`
	Labels map[string]string `json:"labels"`
}

// newerRecord is why a record of a format beyond RecordFormat is refused;
// it carries the record's head, as far as it decodes.
type newerRecord struct{ head recordHead }

func (e *newerRecord) Error() string {
	return fmt.Sprintf("format %d, newer than the %d this sparsevol reads; upgrade sparsevol back to the release that wrote it (or a later one)",
		e.head.Format, RecordFormat)
}

// decodeRecord decodes data, a volume's or snapshot's record, into rec
// under the rule of record formats, the one home of it: data is a JSON
// object whose "format" (0 where it has none) is a whole number from 0.
// A record of a format beyond RecordFormat is not decoded into rec: what
// an older binary would make of its fields is not what they mean. The
// error carries no class; recordClass says which.
func decodeRecord(data []byte, rec any) error {
	var f struct {
		Format int `json:"format"`
	}
	if err := json.Unmarshal(data, &f); err != nil {
		return err
	}
	switch {
	case f.Format < 0:
		return fmt.Errorf("format %d is negative", f.Format)
	case f.Format > RecordFormat:
		e := &newerRecord{head: recordHead{Format: f.Format}}
		json.Unmarshal(data, &e.head) // as far as it decodes: standInHead checks it
		e.head.Format = f.Format
		return e
	}
	return json.Unmarshal(data, rec)
}

// recordClass is the class of an error reading a record (decodeRecord, or
// a rule its fields break): ErrNewer for a newer format, else ErrBroken.
func recordClass(err error) error {
	var newer *newerRecord
	if errors.As(err, &newer) {
		return ErrNewer
	}
	return ErrBroken
}

// standInHead is what a listing's stand-in for a record refused with err
// shows of it: state newer, the format, and the name and labels of the
// record's head where it names the record's own UUID and they pass
// ValidateName and ValidateLabels (else the UUID as name, no labels),
// for a newer record (ErrNewer); state broken and the UUID as name for
// any other.
func standInHead(uuid string, err error) (State, recordHead) {
	var newer *newerRecord
	if !errors.As(err, &newer) {
		return StateBroken, recordHead{UUID: uuid, Name: uuid}
	}
	h := recordHead{Format: newer.head.Format, UUID: uuid, Name: uuid}
	if newer.head.UUID == uuid && ValidateName(newer.head.Name) == nil {
		h.Name = newer.head.Name
		if ValidateLabels(newer.head.Labels) == nil {
			h.Labels = newer.head.Labels
		}
	}
	return StateNewer, h
}
